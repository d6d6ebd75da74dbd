"""The Triton-vs-reference kernel tests of tests/cpu/kernels, on CUDA with compiled kernels.

Run with `pytest tests/gpu` on a machine with a GPU; skipped elsewhere.
"""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

_CPU_TESTS = Path(__file__).resolve().parents[1] / "cpu" / "kernels"
sys.path.insert(0, str(_CPU_TESTS))  # for kernels_testlib
_spec = importlib.util.spec_from_file_location(
    "cpu_triton_agreement", _CPU_TESTS / "test_triton_agreement.py"
)
_cases = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_cases)

test_tree_buffers = _cases.test_tree_buffers
test_verify_same_samples_from_the_same_randoms = _cases.test_verify_same_samples_from_the_same_randoms
test_kv_compaction = _cases.test_kv_compaction
test_logits_processing = _cases.test_logits_processing


@pytest.fixture
def device() -> str:
    return "cuda"


@pytest.fixture
def triton_backend() -> str:
    return "triton"


def test_auto_backend_picks_triton_on_cuda() -> None:
    from outrider.kernels.backend import use_triton

    assert use_triton(None, torch.device("cuda"))
