"""Tensor parallelism: the rank group a model is sharded over, and a launcher for N ranks."""

from outrider.target_worker.parallel.group import TPGroup
from outrider.target_worker.parallel.launcher import launch

__all__ = ["TPGroup", "launch"]
