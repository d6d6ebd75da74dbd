"""Outrider: proto."""
