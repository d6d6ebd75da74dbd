"""Outrider: kernels."""
