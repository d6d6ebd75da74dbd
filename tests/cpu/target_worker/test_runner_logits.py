"""Runner logits and hidden states equal transformers' own implementation (fp32, 1e-4)."""

from __future__ import annotations

import pytest
import torch
from target_runner_testlib import FAMILIES, reference_logits, run_scenario

from outrider.target_worker.batch import HiddenCapture, SequenceChunk, build_forward_batch
from outrider.target_worker.runner import ModelRunner

ATOL = 1e-4


@pytest.fixture(scope="module")
def runners(checkpoints):
    return {f: ModelRunner.from_pretrained(path, max_model_len=64) for f, (path, _) in checkpoints.items()}


@pytest.mark.parametrize("family", FAMILIES)
def test_ragged_scenario_matches_transformers(family, checkpoints, runners):
    """Prefill, decode, chunked prefill, trees and mixed batches: every row vs a plain forward."""
    _, model = checkpoints[family]
    scenario = run_scenario(runners[family], model.config.vocab_size)
    cache: dict[tuple[int, ...], torch.Tensor] = {}
    for step, (logits, rows) in enumerate(zip(scenario.logits, scenario.rows, strict=True)):
        assert logits.shape == (len(rows), model.config.vocab_size)
        for row, sequence in enumerate(rows):
            key = tuple(sequence)
            if key not in cache:
                cache[key] = reference_logits(model, sequence)
            diff = (logits[row] - cache[key]).abs().max().item()
            assert diff <= ATOL, f"{family} step {step} row {row} (length {len(sequence)}): {diff}"


@pytest.mark.parametrize("all_logits", [False, True])  # True: no logits_rows, the final norm reuses
@pytest.mark.parametrize("family", ["llama", "qwen3"])  # the logits' row scale
def test_captured_hidden_states_match_transformers(family, all_logits, checkpoints, runners):
    path, model = checkpoints[family]
    runner = runners[family]
    num_layers = model.config.num_hidden_layers
    ids = torch.randint(0, model.config.vocab_size, (11,), generator=torch.Generator().manual_seed(3))
    start = runner.cache.allocate(99, 16)
    capture = HiddenCapture.eagle3(num_layers)
    batch = build_forward_batch([SequenceChunk(start, 0, ids, all_logits=all_logits)], capture=capture)
    assert (batch.logits_rows is None) == all_logits
    out = runner.forward(batch)
    runner.cache.free(99)
    with torch.no_grad():
        reference = model(ids[None], output_hidden_states=True).hidden_states  # L+1; [i] = input of layer i
    assert set(out.layer_inputs) == {2, num_layers // 2, num_layers - 3}
    for layer, hidden in out.layer_inputs.items():
        assert (hidden - reference[layer][0]).abs().max() <= ATOL
    assert (out.final_hidden - reference[-1][0]).abs().max() <= ATOL  # after the final norm
    # A prompt chunk returns only its last row, unless all are asked for.
    assert out.logits.shape == (11 if all_logits else 1, model.config.vocab_size)


def test_bf16_runner_close_to_transformers_bf16(tmp_path):
    import transformers
    from target_runner_testlib import save_random_checkpoint

    save_random_checkpoint(tmp_path, "qwen3", dtype=torch.bfloat16)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    runner = ModelRunner.from_pretrained(tmp_path, max_model_len=32)
    assert runner.model.dtype == torch.bfloat16  # the checkpoint's dtype by default
    ids = torch.randint(0, 97, (8,), generator=torch.Generator().manual_seed(1))
    start = runner.cache.allocate(0, 32)
    ours = runner.forward(build_forward_batch([SequenceChunk(start, 0, ids, all_logits=True)])).logits
    with torch.no_grad():
        theirs = model(ids[None]).logits[0]
    scale = theirs.float().abs().max()
    assert (ours.float() - theirs.float()).abs().max() <= 0.05 * scale
