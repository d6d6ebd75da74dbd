"""Medusa head checkpoints: the two published layouts, read into one `MedusaHeads`.

Safetensors only; `.pt`/`.bin` are pickle and refused.

    FasterDecoding  medusa_lm_head.safetensors   {k}.{j}.linear.weight [H, H], {k}.{j}.linear.bias [H]
                                                 (j < medusa_num_layers), {k}.{L}.weight [V, H]
                    config.json                  medusa_num_heads, medusa_num_layers, hidden_size,
                                                 vocab_size, base_model_name_or_path
    vLLM            *.safetensors                blocks.{k}.layers.{j}.weight (+ .bias), lm_heads.{k}.weight
                                                 or one shared lm_head.weight, optional token_map
                    config.json                  num_heads, num_hidden_layers (per head), hidden_size,
                                                 vocab_size, truncated_vocab_size

Medusa-2 keeps FasterDecoding's keys inside the whole model's files, under `medusa_head.`.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from outrider.draft_worker.medusa.heads import HEADS_FILE, MedusaHeads
from outrider.target_worker.loader import CheckpointError, CheckpointReader

log = logging.getLogger(__name__)


def load_medusa_heads(path: str | Path, dtype: torch.dtype | None = None) -> tuple[MedusaHeads, dict]:
    """(heads, config.json) from a FasterDecoding- or vLLM-layout folder; never reads pickle."""
    path = Path(path)
    pickled = sorted(p.name for p in (*path.glob("*.pt"), *path.glob("*.bin")))
    if pickled and not list(path.glob("*.safetensors")):
        raise CheckpointError(
            f"medusa: {path} holds only pickle weights ({', '.join(pickled)}), which are never loaded; "
            f"convert them once, where you trust the file, to safetensors: "
            f"safetensors.torch.save_file(torch.load(f, weights_only=True), '{HEADS_FILE}')"
        )
    reader = CheckpointReader(path)
    config = reader.config
    dtype = dtype or reader.checkpoint_dtype
    if "medusa_num_heads" in config or reader.has("0.1.weight") or reader.has("medusa_head.0.1.weight"):
        heads = _read_faster_decoding(reader, config, dtype)
    elif "num_heads" in config and reader.has("blocks.0.layers.0.weight"):
        heads = _read_vllm(reader, config, dtype)
    else:
        raise CheckpointError(
            f"medusa: {path} is neither FasterDecoding's layout ('{{k}}.0.linear.weight', "
            "config medusa_num_heads) nor vLLM's ('blocks.{k}.layers.0.weight', config num_heads)"
        )
    if heads.share_identical_heads():
        log.info(
            "medusa: the %d heads of %s share one lm_head; it is read once per round", heads.num_heads, path
        )
    return heads.eval().requires_grad_(False), config


def _read_faster_decoding(reader: CheckpointReader, config: dict, dtype: torch.dtype) -> MedusaHeads:
    layers = int(config.get("medusa_num_layers", 1))
    # Medusa-2 saves the heads inside the whole model, as `medusa_head.{k}...`.
    prefix = "medusa_head." if reader.has(f"medusa_head.0.{layers}.weight") else ""
    num_heads = int(config.get("medusa_num_heads", 0))
    if not num_heads:  # no config count: as many heads as the file holds
        while reader.has(f"{prefix}{num_heads}.{layers}.weight"):
            num_heads += 1
    vocab, hidden = reader.shape(f"{prefix}0.{layers}.weight")
    heads = MedusaHeads(num_heads, layers, hidden, vocab).to(dtype)
    for k in range(num_heads):
        for j in range(layers):
            heads.block_weight.data[k, j] = reader.read(f"{prefix}{k}.{j}.linear.weight", dtype)
            if reader.has(f"{prefix}{k}.{j}.linear.bias"):
                heads.block_bias.data[k, j] = reader.read(f"{prefix}{k}.{j}.linear.bias", dtype)
        heads.lm_head.data[k] = reader.read(f"{prefix}{k}.{layers}.weight", dtype)
    return heads


def _read_vllm(reader: CheckpointReader, config: dict, dtype: torch.dtype) -> MedusaHeads:
    num_heads, layers = int(config["num_heads"]), int(config.get("num_hidden_layers", 1))
    shared = not reader.has("lm_heads.0.weight")
    vocab, hidden = reader.shape("lm_head.weight" if shared else "lm_heads.0.weight")
    heads = MedusaHeads(num_heads, layers, hidden, vocab, shared_head=shared).to(dtype)
    for k in range(num_heads):
        for j in range(layers):
            heads.block_weight.data[k, j] = reader.read(f"blocks.{k}.layers.{j}.weight", dtype)
            if reader.has(f"blocks.{k}.layers.{j}.bias"):
                heads.block_bias.data[k, j] = reader.read(f"blocks.{k}.layers.{j}.bias", dtype)
        if not shared:
            heads.lm_head.data[k] = reader.read(f"lm_heads.{k}.weight", dtype)
    if shared:
        heads.lm_head.data[0] = reader.read("lm_head.weight", dtype)
    if reader.has("token_map"):
        heads.token_map = reader.read("token_map", torch.int64)
    return heads


def target_num_layers(config: dict, options_value: int | None) -> int:
    """The target's layer count L (its final hidden state is feature layer L)."""
    if options_value is not None:
        return options_value
    # FasterDecoding's full configs are the base model's config plus the medusa_* keys (vLLM's
    # num_hidden_layers counts the heads' own blocks instead, so it is not read there).
    if "medusa_num_heads" in config and "num_hidden_layers" in config:
        return int(config["num_hidden_layers"])
    base = config.get("base_model_name_or_path")
    if base and (Path(base) / "config.json").is_file():
        return int(json.loads((Path(base) / "config.json").read_text())["num_hidden_layers"])
    raise ValueError(
        "medusa: cannot tell how many layers the target has (its final hidden state is feature "
        f"layer num_hidden_layers); base_model_name_or_path = {base!r} is not a local folder. "
        "Give the key target_num_layers"
    )
