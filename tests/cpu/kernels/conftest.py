"""Run Triton kernels on CPU through Triton's interpreter.

triton decides at import time whether `@triton.jit` builds interpreted functions (its own
standard library included), so TRITON_INTERPRET=1 must be set before anything imports it.
`kernels` imports triton only when a Triton kernel launches, so setting it while this
conftest loads is early enough unless another package imported triton first; the
`triton_backend` fixture then skips with the reason. On a CUDA machine nothing is set: the
compiled kernels are tested by tests/gpu.

The variable stays set for the rest of the process: it only changes how `@triton.jit`
functions defined from now on are built, and on a CPU-only machine no compiled Triton kernel
could run anyway.
"""

import os
import sys

import pytest
import torch

if "triton" not in sys.modules and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _interpreter_active() -> bool:
    try:
        import triton.language as tl
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:
        return False
    return isinstance(tl.standard.max, InterpretedFunction)


@pytest.fixture
def triton_backend() -> str:
    if not _interpreter_active():
        pytest.skip(
            "Triton's interpreter is not active (triton missing, or imported before TRITON_INTERPRET=1)"
        )
    return "triton"


@pytest.fixture(autouse=True)
def one_torch_thread():
    """These tests run many small ops; on a shared 2-core machine intra-op threads spin-wait
    against each other and make them ~10x slower. Restored afterwards for other tests."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
