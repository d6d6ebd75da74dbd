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


_paged_spec = importlib.util.spec_from_file_location(
    "cpu_paged_attention", _CPU_TESTS / "test_paged_attention.py"
)
_paged = importlib.util.module_from_spec(_paged_spec)
_paged_spec.loader.exec_module(_paged)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "dtype"), [(4, 2, 16, torch.float32), (32, 8, 128, torch.bfloat16)]
)
def test_paged_attention(heads: int, kv_heads: int, dim: int, dtype: torch.dtype) -> None:
    """The compiled paged-attention kernel against the torch reference, on CUDA (fp32 and the
    8B shape's heads in bf16)."""
    from outrider.kernels.paged_attention import paged_attention

    q, k, v, meta, _, _ = _paged._batch(torch.Generator().manual_seed(heads), heads, kv_heads, dim)
    q, k, v = (x.to("cuda", dtype) for x in (q, k, v))
    meta = tuple(m.to("cuda") if isinstance(m, torch.Tensor) else m for m in meta)
    ref = paged_attention(q, k, v, *meta, backend="torch").float()
    got = paged_attention(q, k, v, *meta, backend="triton").float()
    assert torch.allclose(got, ref, atol=1e-5 if dtype == torch.float32 else 2e-2)
