"""Which implementation runs a kernel op: the torch reference or the Triton kernel.

Every op in this package has both, with the same signature. `backend="auto"` (the default)
picks Triton for CUDA tensors when triton is installed and torch everywhere else; the
`OUTRIDER_KERNEL_BACKEND` environment variable overrides the default for a whole process.
`backend="triton"` on CPU tensors runs the kernels in Triton's interpreter, which needs
`TRITON_INTERPRET=1` in the environment *before triton is first imported* (triton decides
how to build `@triton.jit` functions, its own standard library included, at import time).
Nothing in `kernels` imports triton until a Triton kernel is actually launched.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from typing import Literal

import torch

Backend = Literal["auto", "torch", "triton"]
BACKEND_ENV = "OUTRIDER_KERNEL_BACKEND"


@functools.cache
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def use_triton(backend: Backend | None, device: torch.device) -> bool:
    """True when the Triton kernel should run for tensors on `device`."""
    choice = backend or os.environ.get(BACKEND_ENV, "auto")
    if choice == "torch":
        return False
    if choice == "triton":
        if not triton_available():
            raise RuntimeError("backend='triton' was asked for but triton is not installed")
        return True
    if choice != "auto":
        raise ValueError(f"unknown kernel backend {choice!r}; expected 'auto', 'torch' or 'triton'")
    return device.type == "cuda" and triton_available()


def next_power_of_2(n: int) -> int:
    """Triton block sizes must be powers of two (at least 1)."""
    return 1 << max(n - 1, 0).bit_length()
