"""The Llama family: Llama 2/3, Mistral, Qwen2/2.5 (q/k/v bias), Qwen3 (per-head q/k norm).

One pre-norm decoder block, differing only in config switches read from config.json:

    h = h + o(attn(rope(norm_qk(split(qkv(norm(h)))))))      all-reduce after o
    h = h + down(silu(gate(x)) * up(x)), x = norm(h)         all-reduce after down

Each norm is folded into the matmul after it (`layers.norm`), and each residual add into
the matmul before it (`addmm(h, ., W)`, on rank 0 only under TP).

Weights are fused at load (q|k|v -> qkv, gate|up -> gate_up) and sliced for this TP rank;
q and k rows are permuted per head for the interleaved RoPE of `layers.rope`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from outrider.target_worker.batch import ForwardBatch, ForwardOutput
from outrider.target_worker.kv_cache import KVSpec
from outrider.target_worker.layers.attention import AttentionPlan, ragged_attention
from outrider.target_worker.layers.linear import (
    Linear,
    VocabParallelEmbedding,
    VocabParallelHead,
    read_column,
    read_row,
)
from outrider.target_worker.layers.norm import RMSNorm, fold_norm, rms_scale
from outrider.target_worker.layers.rope import RotaryEmbedding, interleave_rotary_rows, rope_parameters_of
from outrider.target_worker.loader import CheckpointError, CheckpointReader
from outrider.target_worker.models.registry import register_architecture
from outrider.target_worker.parallel.group import TPGroup


@dataclass(frozen=True)
class LlamaFamilyConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: dict[str, Any]
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    sliding_window: int | None  # None = full attention

    @staticmethod
    def from_hf(cfg: dict[str, Any]) -> LlamaFamilyConfig:
        model_type = cfg.get("model_type", "llama")
        if cfg.get("hidden_act", "silu") != "silu":
            raise CheckpointError(f"hidden_act {cfg['hidden_act']!r} is not supported (only 'silu')")
        heads = cfg["num_attention_heads"]
        kv_heads = cfg.get("num_key_value_heads") or heads
        if heads % kv_heads:
            raise CheckpointError(
                f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}"
            )
        attention_bias = bool(cfg.get("attention_bias", False))
        uses_window = cfg.get("use_sliding_window", model_type == "mistral")
        return LlamaFamilyConfig(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope=rope_parameters_of(cfg),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or attention_bias,
            o_bias=attention_bias and model_type != "qwen2",
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=model_type == "qwen3",
            sliding_window=cfg.get("sliding_window") if uses_window else None,
        )


class LlamaBlock:
    def __init__(
        self, reader: CheckpointReader, layer: int, cfg: LlamaFamilyConfig, tp: TPGroup, dtype, device
    ):
        p, d = f"model.layers.{layer}.", cfg.head_dim
        q0, q1 = tp.even_range(cfg.num_heads, "num_attention_heads")
        k0, k1 = tp.kv_head_range(cfg.num_heads, cfg.num_kv_heads)
        i0, i1 = tp.even_range(cfg.intermediate_size, "intermediate_size")
        self.num_heads, self.num_kv_heads, self.head_dim = q1 - q0, k1 - k0, d
        self.tp, self.ffn = tp, i1 - i0
        self.qk_v_widths = [(self.num_heads + self.num_kv_heads) * d, self.num_kv_heads * d]
        self.adds_residual = tp.rank == 0  # row-parallel partial sums carry the residual once
        qkv = [(p + "self_attn.q_proj", q0 * d, q1 * d), (p + "self_attn.k_proj", k0 * d, k1 * d)]
        qkv.append((p + "self_attn.v_proj", k0 * d, k1 * d))
        rows = torch.cat(
            [
                interleave_rotary_rows(self.num_heads + self.num_kv_heads, d),
                torch.arange(
                    (self.num_heads + self.num_kv_heads) * d, (self.num_heads + 2 * self.num_kv_heads) * d
                ),
            ]
        )
        eps = self.eps = cfg.rms_norm_eps
        input_norm = reader.read(p + "input_layernorm.weight", dtype).to(device)
        post_norm = reader.read(p + "post_attention_layernorm.weight", dtype).to(device)
        self.qkv = Linear(
            fold_norm(
                read_column(reader, [(n + ".weight", a, b) for n, a, b in qkv], dtype, device)[rows],
                input_norm,
            ),
            read_column(reader, [(n + ".bias", a, b) for n, a, b in qkv], dtype, device)[rows]
            if cfg.qkv_bias
            else None,
        )
        o_bias = reader.read(p + "self_attn.o_proj.bias", dtype).to(device) if cfg.o_bias else None
        # Row-parallel: partial sums are all-reduced, so only rank 0 adds the bias.
        self.o = Linear(
            read_row(reader, p + "self_attn.o_proj.weight", q0 * d, q1 * d, dtype, device),
            o_bias if tp.rank == 0 else None,
        )
        mlp = [(p + "mlp.gate_proj", i0, i1), (p + "mlp.up_proj", i0, i1)]
        self.gate_up = Linear(
            fold_norm(
                read_column(reader, [(n + ".weight", a, b) for n, a, b in mlp], dtype, device), post_norm
            ),
            read_column(reader, [(n + ".bias", a, b) for n, a, b in mlp], dtype, device)
            if cfg.mlp_bias
            else None,
        )
        down_bias = reader.read(p + "mlp.down_proj.bias", dtype).to(device) if cfg.mlp_bias else None
        self.down = Linear(
            read_row(reader, p + "mlp.down_proj.weight", i0, i1, dtype, device),
            down_bias if tp.rank == 0 else None,
        )
        self.qk_norm = None
        if cfg.qk_norm:
            # Per-head RMSNorm of q and k in one call: queries then keys, each [D] weight repeated per head.
            q_w = reader.read(p + "self_attn.q_norm.weight", dtype).to(device)
            k_w = reader.read(p + "self_attn.k_norm.weight", dtype).to(device)
            weight = torch.cat([q_w.expand(self.num_heads, d), k_w.expand(self.num_kv_heads, d)])
            self.qk_norm = RMSNorm(weight[:, interleave_rotary_rows(1, d)], eps)

    def __call__(
        self,
        h: torch.Tensor,  # [T, H] residual stream
        rotation: torch.Tensor,  # [T, 1, D/2] complex
        rows: torch.Tensor,  # [T] cache rows to write
        plan: AttentionPlan,
        kv: tuple[torch.Tensor, torch.Tensor],  # k, v: [rows, H_kv, D]
    ) -> torch.Tensor:
        t, hq, hkv, d = h.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv.scaled(h, rms_scale(h, self.eps))  # [T, (H_q + 2 H_kv) D], input norm folded in
        qk, v = qkv.split(self.qk_v_widths, dim=1)
        qk = qk.view(t, hq + hkv, d)
        if self.qk_norm is not None:
            qk = self.qk_norm(qk)
        qk = RotaryEmbedding.apply(qk, rotation)
        k_cache, v_cache = kv
        k_cache.index_copy_(0, rows, qk[:, hq:])
        v_cache.index_copy_(0, rows, v.view(t, hkv, d))
        attn = ragged_attention(qk[:, :hq], k_cache, v_cache, plan)  # [T, H_q, D]
        h = self.tp.all_reduce(self.o(attn.reshape(t, hq * d), h if self.adds_residual else None))
        gate, up = self.gate_up.scaled(h, rms_scale(h, self.eps)).split(
            self.ffn, dim=1
        )  # post-attn norm folded
        return self.tp.all_reduce(self.down(F.silu(gate).mul_(up), h if self.adds_residual else None))


@register_architecture(
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
)
class LlamaFamilyModel:
    def __init__(
        self, cfg: LlamaFamilyConfig, reader: CheckpointReader, tp: TPGroup, dtype, device, max_positions
    ):
        self.cfg, self.tp, self.dtype = cfg, tp, dtype
        self.num_layers, self.hidden_size, self.vocab_size = cfg.num_layers, cfg.hidden_size, cfg.vocab_size
        v0, v1, per_rank = tp.padded_range(cfg.vocab_size)
        embed = reader.read("model.embed_tokens.weight", dtype, dim=0, start=v0, stop=v1).to(device)
        self.embed = VocabParallelEmbedding(embed, v0, v1, tp)
        head = (
            embed
            if cfg.tie_word_embeddings
            else reader.read("lm_head.weight", dtype, dim=0, start=v0, stop=v1)
        )
        self.norm = RMSNorm(reader.read("model.norm.weight", dtype).to(device), cfg.rms_norm_eps)
        self.final_gain = self.norm.weight * math.sqrt(cfg.hidden_size)  # the norm, given rms_scale
        self.head = VocabParallelHead(
            fold_norm(head.to(device), self.norm.weight), per_rank, cfg.vocab_size, tp
        )
        self.blocks = [LlamaBlock(reader, i, cfg, tp, dtype, device) for i in range(cfg.num_layers)]
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.rope, max_positions, device)

    @classmethod
    def from_checkpoint(cls, reader, tp, dtype, device, max_positions) -> LlamaFamilyModel:
        cfg = LlamaFamilyConfig.from_hf(reader.config)
        if cfg.sliding_window is not None and max_positions > cfg.sliding_window:
            # Within the window sliding attention equals full attention; past it we would be wrong.
            raise CheckpointError(
                f"max_model_len {max_positions} exceeds sliding_window {cfg.sliding_window}, "
                "and sliding-window attention is not implemented; use max_model_len <= the window"
            )
        return cls(cfg, reader, tp, dtype, device, max_positions)

    def kv_spec(self) -> KVSpec:
        block = self.blocks[0]
        shape = (block.num_kv_heads, block.head_dim)
        return KVSpec(num_layers=self.num_layers, buffers=(("k", shape), ("v", shape)), dtype=self.dtype)

    def forward(
        self, batch: ForwardBatch, plan: AttentionPlan, kv_layers: list[tuple[torch.Tensor, ...]]
    ) -> ForwardOutput:
        capture = batch.capture
        h = self.embed(batch.input_ids)  # [T, H]
        rotation = self.rope.lookup(batch.positions)
        layer_inputs = {}
        for i, (block, kv) in enumerate(zip(self.blocks, kv_layers, strict=True)):
            if i in capture.layer_inputs:
                layer_inputs[i] = h
            h = block(h, rotation, batch.cache_rows, plan, kv)
        rows = h if batch.logits_rows is None else h[batch.logits_rows]
        scale = rms_scale(rows, self.cfg.rms_norm_eps)
        final = None
        if capture.final:  # fp32 decode: the logits' row scale serves (F.rms_norm is ~25 us on CPU)
            final = h * scale * self.final_gain if rows is h and h.dtype == torch.float32 else self.norm(h)
        return ForwardOutput(
            logits=self.head(rows, scale),  # final norm folded in
            final_hidden=final,
            layer_inputs=layer_inputs,
        )
