"""Medusa test helpers: random heads written in exactly the two published layouts, an
independent reference for their logits, and a small proposer over them."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from outrider.draft_worker import build_proposer
from outrider.draft_worker.medusa.heads import HEADS_FILE
from outrider.proto import SamplingParams, SequenceUpdate, TreeBudget

CHOICES = [(0,), (1,), (0, 0), (2,), (0, 1), (1, 0), (0, 0, 0)]


def random_heads(num_heads: int, hidden: int, vocab: int, seed: int = 0, scale: float = 1.0) -> dict:
    """Per-head tensors {w [H, H], b [H], lm [V, H]} with non-zero blocks, so the ResBlock matters."""
    gen = torch.Generator().manual_seed(seed)
    return [
        {
            "w": torch.randn(hidden, hidden, generator=gen) * 0.3 / hidden**0.5,
            "b": torch.randn(hidden, generator=gen) * 0.1,
            "lm": torch.randn(vocab, hidden, generator=gen) * scale / hidden**0.5,
        }
        for _ in range(num_heads)
    ]


def _write(folder: Path, file: str, tensors: dict[str, torch.Tensor], fields: dict, config: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, folder / file)
    (folder / "config.json").write_text(json.dumps(fields | config))
    return folder


def write_faster_decoding(folder: Path, heads: list[dict], **config) -> Path:
    """FasterDecoding's layout: medusa_lm_head.safetensors with `{k}.0.linear.*` and `{k}.1.weight`."""
    tensors = {}
    for k, head in enumerate(heads):
        tensors |= {
            f"{k}.0.linear.weight": head["w"],
            f"{k}.0.linear.bias": head["b"],
            f"{k}.1.weight": head["lm"],
        }
    vocab, hidden = heads[0]["lm"].shape
    fields = dict(medusa_num_heads=len(heads), medusa_num_layers=1, hidden_size=hidden, vocab_size=vocab)
    return _write(folder, HEADS_FILE, tensors, fields, config)


def write_vllm(folder: Path, heads: list[dict], **config) -> Path:
    """vLLM's layout: `blocks.{k}.layers.0.weight/bias`, `lm_heads.{k}.weight`."""
    tensors = {}
    for k, head in enumerate(heads):
        layer = f"blocks.{k}.layers.0"
        tensors |= {
            f"{layer}.weight": head["w"],
            f"{layer}.bias": head["b"],
            f"lm_heads.{k}.weight": head["lm"],
        }
    vocab, hidden = heads[0]["lm"].shape
    fields = dict(
        num_heads=len(heads), num_hidden_layers=1, hidden_size=hidden, vocab_size=vocab, medusa_fc_bias=True
    )
    return _write(folder, "model.safetensors", tensors, fields, config)


def reference_logits(heads: list[dict], hidden: torch.Tensor) -> torch.Tensor:
    """[K, V]: head k = lm_k(h + SiLU(W_k h + b_k)), written out independently of MedusaHeads."""
    rows = []
    for head in heads:
        x = hidden + torch.nn.functional.silu(head["w"] @ hidden + head["b"])
        rows.append(head["lm"] @ x)
    return torch.stack(rows)


VOCAB, HIDDEN = 12, 8


def small_proposer(folder: Path, **keys):
    config = {"method": "medusa", "model": str(folder), "num_speculative_tokens": 3, "target_num_layers": 2}
    return build_proposer(config | keys, vocab_size=VOCAB)


GREEDY, BUDGET = SamplingParams(), TreeBudget(max_nodes=8, max_depth=3, top_k=3)


def update(seq_id, hidden, *, tokens=(3,), sampling=GREEDY, budget=BUDGET, **kw):
    features = torch.zeros(len(tokens), hidden.shape[0])
    features[-1] = hidden
    return SequenceUpdate(seq_id, 0, torch.tensor(tokens), sampling, budget, features=features, **kw)
