"""DeepSeek-V3 on CUDA in bf16 against the CPU fp32 runner, and `mtp` drafting on the device.

Run on a GPU machine: `.venv/bin/python -m pytest tests/gpu/target_worker/test_deepseek_cuda.py -q`.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[2] / "cpu" / "target_worker"))
from deepseek_testlib import quantize_checkpoint, save_random_deepseek  # noqa: E402
from target_runner_testlib import run_scenario  # noqa: E402

from outrider.draft_worker import build_proposer  # noqa: E402
from outrider.target_worker.draft_source import InProcessDraftSource  # noqa: E402
from outrider.target_worker.engine import Engine  # noqa: E402
from outrider.target_worker.runner import ModelRunner  # noqa: E402
from outrider.target_worker.sequence import RequestParams  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("fp8", [False, True])
def test_bf16_cuda_scenario_close_to_fp32_cpu(tmp_path, fp8):
    path = tmp_path / "ds"
    save_random_deepseek(path)
    if fp8:
        quantize_checkpoint(path, tmp_path / "fp8", block=(32, 16))
        path = tmp_path / "fp8"
    cpu = run_scenario(ModelRunner.from_pretrained(path, max_model_len=64), 97)
    gpu = run_scenario(
        ModelRunner.from_pretrained(path, max_model_len=64, device="cuda", dtype=torch.bfloat16), 97
    )
    close = agree = total = 0
    for a, b in zip(cpu.logits, gpu.logits, strict=True):
        b = b.float().cpu()
        # bf16 keeps ~3 significant digits per layer; a token whose expert scores nearly tie
        # may route differently in bf16 (top-k is discontinuous), so a few rows may differ more.
        error = (a - b).abs().amax(-1)  # [rows]
        close += int((error <= 0.05 * a.abs().amax(-1) + 0.05).sum())
        agree += int((a.argmax(-1) == b.argmax(-1)).sum())
        total += a.shape[0]
    assert close >= 0.9 * total and agree >= 0.9 * total, (close, agree, total)


def test_mtp_greedy_equals_plain_on_cuda(tmp_path):
    path = tmp_path / "ds"
    save_random_deepseek(path, with_mtp=True)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 97, (n,), generator=gen).tolist() for n in (5, 11, 8)]
    params = RequestParams(max_tokens=20, ignore_eos=True)

    def engine(spec):
        runner = ModelRunner.from_pretrained(path, max_model_len=64, kv_cache_rows=512, device="cuda")
        source = None
        if spec:
            source = InProcessDraftSource(build_proposer(spec, vocab_size=97, device="cuda"))
        return Engine(runner, source, eos_token_id=None, max_batch=4)

    plain = [c.token_ids for c in engine(None).generate(prompts, params)]
    spec_engine = engine({"method": "mtp", "model": str(path), "num_speculative_tokens": 3})
    assert [c.token_ids for c in spec_engine.generate(prompts, params)] == plain
    assert spec_engine.stats.spec.num_drafts > 0
