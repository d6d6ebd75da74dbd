"""DeepSeek-V3 in the target runner against transformers' DeepseekV3ForCausalLM (fp32).

Prefill, decode, chunked prefill and tree verification (the shared ragged scenario) match
transformers' logits; a committed tree path on the latent cache decodes like the plain
sequence; the cache holds latent + rope key only; FP8 block-scaled checkpoints load as
their dequantised weights; TP = 2 on gloo equals TP = 1.
"""

from __future__ import annotations

import pytest
import torch
from deepseek_testlib import (
    dequantized_reference,
    quantize_checkpoint,
    save_random_deepseek,
    tp_rank_check,
)
from target_runner_testlib import reference_logits, run_scenario

from outrider.kernels.kv_compaction import extent_slot_map
from outrider.target_worker.batch import SequenceChunk, build_forward_batch
from outrider.target_worker.models.deepseek_v3 import DeepseekV3Model
from outrider.target_worker.parallel import launch
from outrider.target_worker.runner import ModelRunner

ATOL = 1e-4
VARIANTS = {
    "v3": {},  # q_lora, interleaved rope (the released layout)
    "no-q-lora-rotate-half": dict(q_lora_rank=None, rope_interleave=False, n_shared_experts=2),
}


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def v3(tmp_path_factory):
    path = tmp_path_factory.mktemp("deepseek") / "v3"
    return path, save_random_deepseek(path)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_transformers(tmp_path, v3, variant):
    if variant == "v3":
        path, model = v3
    else:
        path = tmp_path / variant
        model = save_random_deepseek(path, seed=3, **VARIANTS[variant])
    runner = ModelRunner.from_pretrained(path, max_model_len=64)
    assert isinstance(runner.model, DeepseekV3Model)
    scenario = run_scenario(runner, model.config.vocab_size)
    worst = 0.0
    for logits, rows in zip(scenario.logits, scenario.rows, strict=True):
        assert logits.shape[0] == len(rows)
        for row, sequence in zip(logits, rows, strict=True):
            worst = max(worst, (row - reference_logits(model, sequence)).abs().max().item())
    assert worst <= ATOL, worst


def test_routing_is_not_trivial(v3):
    """The scenario really exercises grouped routing: groups and the bias change the choice."""
    from outrider.target_worker.layers.moe import Routing, route

    path, model = v3
    block = ModelRunner.from_pretrained(path, max_model_len=64).model.blocks[1]
    x = torch.randn(256, model.config.hidden_size)
    ids, _ = route(x, block.mlp.gate_t, block.mlp.bias, block.mlp.routing)
    assert ids.unique().numel() == model.config.n_routed_experts
    ungrouped = Routing(**{**block.mlp.routing.__dict__, "n_group": 1, "topk_group": 1})
    assert not torch.equal(
        ids.sort(1).values, route(x, block.mlp.gate_t, block.mlp.bias, ungrouped)[0].sort(1).values
    )


def test_cache_holds_latent_and_rope_key_only(v3):
    path, model = v3
    cfg = model.config
    runner = ModelRunner.from_pretrained(path, max_model_len=64, kv_cache_rows=100)
    per_token = (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * cfg.num_hidden_layers * 4  # fp32
    assert runner.cache.spec.bytes_per_row() == per_token
    allocated = sum(b.numel() * b.element_size() for b in runner.cache.buffers.values())
    assert allocated == per_token * 100
    # A full MHA cache would be 2 x heads x head_dim per layer: 4x more even at this tiny size.
    assert per_token * 4 < 2 * cfg.num_attention_heads * cfg.qk_head_dim * cfg.num_hidden_layers * 4


def test_commit_tree_path_on_latent_cache(v3):
    """Verify a tree, compact the accepted path's latent rows, decode on: transformers' logits."""
    path, model = v3
    runner = ModelRunner.from_pretrained(path, max_model_len=64)
    gen = torch.Generator().manual_seed(5)
    start = runner.cache.allocate(0, 40)
    prompt = torch.randint(0, 97, (7,), generator=gen)
    runner.forward(build_forward_batch([SequenceChunk(start, 0, prompt)]))
    parents = [-1, 0, 0, 1, 2, 4, 4]
    tree = torch.randint(0, 97, (7,), generator=gen)  # node 0 = the root, the last committed token
    runner.forward(build_forward_batch([SequenceChunk(start, 7, tree, parents=torch.tensor(parents))]))
    accepted = [2, 4, 6]  # root -> 2 -> 4 -> 6
    runner.cache.compact(torch.tensor([accepted]), extent_slot_map(torch.tensor([start + 7]), 7))
    context = prompt.tolist() + [int(tree[0])] + tree[accepted].tolist()
    bonus = torch.tensor([11])
    out = runner.forward(build_forward_batch([SequenceChunk(start, len(context), bonus)]))
    expected = reference_logits(model, context + [11])
    assert (out.logits[0] - expected).abs().max() <= ATOL


def test_fp8_block_scaled_checkpoint_round_trip(tmp_path, v3):
    path, _ = v3
    fp8, reference = tmp_path / "fp8", tmp_path / "dequantized"
    quantize_checkpoint(path, fp8, block=(32, 16))  # partial blocks: e.g. kv_a has 40 rows
    dequantized_reference(path, fp8, reference)
    from safetensors import safe_open

    with safe_open(fp8 / "model.safetensors", "pt") as f:
        weight = f.get_tensor("model.layers.1.self_attn.kv_a_proj_with_mqa.weight")
        scale = f.get_tensor("model.layers.1.self_attn.kv_a_proj_with_mqa.weight_scale_inv")
    assert weight.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
    assert scale.shape == (2, 4)  # ceil(40 / 32) x ceil(64 / 16)
    ours = run_scenario(ModelRunner.from_pretrained(fp8, max_model_len=64), 97)
    plain = run_scenario(ModelRunner.from_pretrained(reference, max_model_len=64), 97)
    for a, b in zip(ours.logits, plain.logits, strict=True):
        assert (a - b).abs().max() <= 1e-5
    # And the quantisation really happened (the dequantised weights differ from the originals).
    original = run_scenario(ModelRunner.from_pretrained(path, max_model_len=64), 97)
    assert max((a - b).abs().max().item() for a, b in zip(ours.logits, original.logits, strict=True)) > 1e-3


def test_tp2_gloo_equals_tp1(tmp_path, v3):
    path, _ = v3
    fp8 = tmp_path / "fp8"
    quantize_checkpoint(path, fp8, block=(32, 16))  # shards cut through FP8 blocks
    no_q_lora = tmp_path / "no-q-lora"
    save_random_deepseek(no_q_lora, seed=4, **VARIANTS["no-q-lora-rotate-half"])
    launch(tp_rank_check, world_size=2, args=([str(path), str(fp8), str(no_q_lora)], ATOL), backend="gloo")
