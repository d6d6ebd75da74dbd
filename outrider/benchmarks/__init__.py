"""Outrider's benchmark harness: rerunnable scripts that write JSON + Markdown reports to results/."""
