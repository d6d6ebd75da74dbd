"""Outrider: cluster."""
