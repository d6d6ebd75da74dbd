"""The runner on the demo target: logits equal transformers' own forward (fp32, 1e-4).

The same ragged scenario as the random tiny configs (prefill, decode, chunked prefill, trees,
mixed batches), on the tiny demo family's trained Llama target and its real tokenizer vocabulary.
"""

from __future__ import annotations

import pytest
import torch
from target_runner_testlib import reference_logits, run_scenario

from outrider.target_worker.runner import ModelRunner

ATOL = 1e-4


@pytest.fixture(scope="module")
def demo_target(tiny_family):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_family.target_dir, dtype=torch.float32)
    return ModelRunner.from_pretrained(tiny_family.target_dir, max_model_len=64), model.eval()


def test_demo_target_logits_match_transformers(demo_target):
    runner, model = demo_target
    scenario = run_scenario(runner, model.config.vocab_size)
    for step, (logits, rows) in enumerate(zip(scenario.logits, scenario.rows, strict=True)):
        assert logits.shape == (len(rows), model.config.vocab_size)
        for row, sequence in enumerate(rows):
            diff = (logits[row] - reference_logits(model, sequence)).abs().max().item()
            assert diff <= ATOL, f"step {step} row {row} (length {len(sequence)}): {diff}"
