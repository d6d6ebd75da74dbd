"""Outrider: draft_worker."""
