"""Shared by the target-runner tests and their TP rank processes (hence not a conftest).

Tiny random checkpoints of each supported family saved as HF safetensors folders, and a
scripted scenario of ragged batches whose every logits row is paired with the plain token
sequence it must match (the row's logits = a plain forward of that sequence, last position).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from outrider.target_worker.batch import HiddenCapture, SequenceChunk, build_forward_batch

FAMILIES = {
    # GQA 4:2, llama3 rope scaling with a short original context so the scaling matters.
    "llama": dict(
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 50000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    ),
    "mistral": dict(sliding_window=4096),
    "qwen2": dict(tie_word_embeddings=True, rope_theta=1000000.0),  # q/k/v bias, tied head
    "qwen3": dict(head_dim=24),  # per-head q/k norm; head_dim != hidden / heads
}

COMMON = dict(
    vocab_size=97,  # odd, so vocab-parallel shards are uneven
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)


def hf_config(family: str, **overrides):
    import transformers

    cls = {
        "llama": transformers.LlamaConfig,
        "mistral": transformers.MistralConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
    }[family]
    return cls(**{**COMMON, **FAMILIES[family], **overrides})


def save_random_checkpoint(path: Path, family: str, seed: int = 0, dtype=torch.float32, **overrides):
    """Saves a random-weight HF model as safetensors; returns the fp32 transformers model."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(family, **overrides), dtype=torch.float32)
    with torch.no_grad():
        # The default init (std 0.02) gives near-uniform logits that hide mistakes.
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.15)
    model.eval().to(dtype).save_pretrained(path, safe_serialization=True)
    return model.float()


def path_to(parents: list[int], node: int) -> list[int]:
    """Local nodes from the root to `node`."""
    path = [node]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    return path[::-1]


@dataclass
class Scenario:
    logits: list[torch.Tensor] = field(default_factory=list)  # per step: [R, V]
    rows: list[list[list[int]]] = field(default_factory=list)  # per step, per row: its plain sequence
    outputs: list = field(default_factory=list)  # per step: the ForwardOutput


def run_scenario(runner, vocab_size: int, seed: int = 0, capture: HiddenCapture | None = None) -> Scenario:
    """Prefill, decode, chunked prefill, trees and mixed batches over three sequences."""
    gen = torch.Generator().manual_seed(seed)
    starts = [runner.cache.allocate(seq, 40) for seq in range(3)]
    committed: list[list[int]] = [[], [], []]  # tokens whose K/V is in the cache
    scenario = Scenario()

    def chain(seq: int, n: int):
        tokens = torch.randint(0, vocab_size, (n,), generator=gen)
        chunk = SequenceChunk(starts[seq], len(committed[seq]), tokens, all_logits=True)
        rows = [committed[seq] + tokens[: i + 1].tolist() for i in range(n)]
        committed[seq] += tokens.tolist()
        return chunk, rows

    def tree(seq: int, parents: list[int]):
        tokens = torch.randint(0, vocab_size, (len(parents),), generator=gen)
        chunk = SequenceChunk(starts[seq], len(committed[seq]), tokens, parents=torch.tensor(parents))
        rows = [committed[seq] + tokens[path_to(parents, j)].tolist() for j in range(len(parents))]
        return chunk, rows  # a tree commits nothing: its rows are stale after this step

    steps = [
        lambda: [chain(0, 9), chain(2, 5)],  # two prefills
        lambda: [chain(0, 1)],  # decode
        lambda: [chain(1, 6), chain(0, 1), tree(2, [-1, 0, 0, 1, 1, 2, 4])],  # prefill + decode + tree
        lambda: [tree(0, [-1, 0, 1, 1, 0, 4, 5]), chain(1, 1), tree(2, [-1, 0, 1, 2, 3])],  # trees reuse rows
        lambda: [chain(1, 3), chain(2, 1)],  # chunked prefill after a context
    ]
    for make_step in steps:
        chunks, rows = zip(*make_step(), strict=True)
        out = runner.forward(build_forward_batch(list(chunks), capture=capture, device=runner.device))
        scenario.logits.append(out.logits)
        scenario.rows.append([r for seq_rows in rows for r in seq_rows])
        scenario.outputs.append(out)
    for seq in range(3):
        runner.cache.free(seq)
    return scenario


def reference_logits(model, sequence: list[int]) -> torch.Tensor:
    """transformers' logits [V] at the last position of a plain forward of `sequence`."""
    with torch.no_grad():
        return model(torch.tensor([sequence])).logits[0, -1]


def tp_rank_check(tp, checkpoint_paths: list[str], atol: float, device: str = "cpu") -> None:
    """Runs in each TP rank: the sharded runner's scenario logits equal an unsharded runner's."""
    from outrider.target_worker.runner import ModelRunner

    if device == "cuda":
        device = f"cuda:{tp.rank}"
    for path in checkpoint_paths:
        sharded = ModelRunner.from_pretrained(path, max_model_len=64, tp=tp, device=device)
        single = ModelRunner.from_pretrained(path, max_model_len=64, device=device)
        # Really sharded: this rank holds half the fused MLP columns.
        assert (
            sharded.model.blocks[0].gate_up.weight_t.shape[1] * 2
            == single.model.blocks[0].gate_up.weight_t.shape[1]
        )
        vocab_size = single.model.vocab_size
        ours = run_scenario(sharded, vocab_size, capture=HiddenCapture(layer_inputs=(1,), final=True))
        reference = run_scenario(single, vocab_size, capture=HiddenCapture(layer_inputs=(1,), final=True))
        for step, (a, b) in enumerate(zip(ours.outputs, reference.outputs, strict=True)):
            where = f"rank {tp.rank}, {path}, step {step}"
            assert a.logits.shape == b.logits.shape, where
            assert (a.logits - b.logits).abs().max() <= atol, where
            assert (a.final_hidden - b.final_hidden).abs().max() <= atol, where
            assert (a.layer_inputs[1] - b.layer_inputs[1]).abs().max() <= atol, where
