"""Target runner on CUDA: same logits as on CPU, and TP=2 over NCCL where two GPUs exist.

Run on a GPU machine: `.venv/bin/python -m pytest tests/gpu/target_worker -q`.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[2] / "cpu" / "target_worker"))
from target_runner_testlib import run_scenario, save_random_checkpoint, tp_rank_check  # noqa: E402

from outrider.target_worker.parallel import launch  # noqa: E402
from outrider.target_worker.runner import ModelRunner  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_cuda_scenario_equals_cpu(family, tmp_path):
    model = save_random_checkpoint(tmp_path, family)
    vocab = model.config.vocab_size
    cpu = run_scenario(ModelRunner.from_pretrained(tmp_path, max_model_len=64), vocab)
    gpu = run_scenario(ModelRunner.from_pretrained(tmp_path, max_model_len=64, device="cuda"), vocab)
    for a, b in zip(cpu.logits, gpu.logits, strict=True):
        # TF32 matmuls may be enabled on the device; compare at a tolerance that allows them.
        assert (a - b.cpu()).abs().max() <= 2e-3


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_tp2_nccl_equals_tp1(tmp_path):
    paths = []
    for family, overrides in [("llama", dict(attention_bias=True)), ("qwen3", dict(num_key_value_heads=1))]:
        save_random_checkpoint(tmp_path / family, family, **overrides)
        paths.append(str(tmp_path / family))
    launch(tp_rank_check, world_size=2, args=(paths, 2e-3, "cuda"), backend="nccl")
