"""Outrider: target_worker."""
