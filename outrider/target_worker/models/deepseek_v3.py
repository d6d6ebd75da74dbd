"""DeepSeek-V3 / R1 (arXiv 2412.19437): Multi-head Latent Attention + mixture of experts.

One pre-norm block, dense MLP in the first `first_k_dense_replace` layers, MoE after:

    a = [q_a | kv_a](norm(h))                       replicated down-projections, input norm folded
    q = q_b(q_a_norm(a_q))  per head [nope | rope]  head-parallel (q_proj without q_lora_rank)
    c_kv = kv_a_norm(a_kv[:L]),  k_pe = rope(a_kv[L:])   -> the cache: L + R values per token
    h = h + o(W_UV . latent_attention(W_UK^T q_nope, rope(q_pe); c_kv, k_pe))   all-reduce
    h = h + moe(norm(h))  (or a dense SwiGLU)                                    all-reduce

MLA's absorbed attention is in `layers.mla`, routing and experts in `layers.moe`, YaRN in
`layers.rope` (its mscale also multiplies the softmax scale, mscale(factor, mscale_all_dim)^2,
as HF and the reference code do). Checkpoints in the HF DeepSeek-V3 layout load as they are,
including the published FP8 weights (`layers.fp8`, dequantised at load). The MTP module
under `model.layers.{num_hidden_layers}` is not part of this model: `draft_worker.mtp`
loads it, with `DeepseekV3Block` for its block.

Rope layout: with `rope_interleave` (the default, and what the released weights use) the
rope dims come in adjacent pairs, which is `layers.rope`'s own layout; otherwise the rope
rows of q_b and kv_a are permuted at load. q and k share the layout, so scores are unchanged.

## Tensor parallelism and multi-node layouts

Within a TP group of N ranks: attention heads are split (q_b / q_proj, kv_b rows and o_proj
columns by head; the latent projections q_a, kv_a and their norms are small and replicated,
so every rank holds the *whole* latent cache: MLA's cache does not shrink with TP), routed
experts are distributed whole across ranks and the shared expert / dense MLP split by their
intermediate dimension (why: `layers.moe`), the vocabulary is split for embedding and head.
Each block costs two all-reduces of [tokens, hidden] (hidden 7168 for V3); with 61 layers a
decode step of B tokens all-reduces 122 x B x 7168 x 2 bytes (bf16): 1.7 MB per token.

A TP group may span nodes (the Ray placement group in `cluster.placement` packs ranks
node-major, so a TP=16 group on 2 x 8 GPUs puts ranks 0-7 on one node and 8-15 on the other;
NCCL's ring/tree then crosses the inter-node link on every all-reduce). See docs/deepseek.md
for the supported layouts, their expected cost, and what to pick on 2 x 8 GPUs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from outrider.target_worker.batch import ForwardBatch, ForwardOutput
from outrider.target_worker.kv_cache import KVSpec
from outrider.target_worker.layers.attention import AttentionPlan
from outrider.target_worker.layers.fp8 import maybe_fp8
from outrider.target_worker.layers.linear import (
    Linear,
    VocabParallelEmbedding,
    VocabParallelHead,
    read_column,
    read_row,
)
from outrider.target_worker.layers.mla import latent_attention
from outrider.target_worker.layers.moe import MoE, Routing, SwiGLU
from outrider.target_worker.layers.norm import RMSNorm, fold_norm, rms_scale
from outrider.target_worker.layers.rope import RotaryEmbedding, interleave_rotary_rows, rope_parameters_of
from outrider.target_worker.loader import CheckpointError, CheckpointReader
from outrider.target_worker.models.registry import register_architecture
from outrider.target_worker.parallel.group import TPGroup

LATENT_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm use the RMSNorm default, not rms_norm_eps


@dataclass(frozen=True)
class DeepseekV3Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    q_lora_rank: int | None  # None: a plain per-head q_proj (DeepSeek-V2-Lite style)
    kv_lora_rank: int  # L
    qk_nope_head_dim: int
    qk_rope_head_dim: int  # R
    v_head_dim: int
    first_k_dense_replace: int
    moe_intermediate_size: int
    n_shared_experts: int
    routing: Routing
    rms_norm_eps: float
    rope: dict[str, Any]
    rope_interleave: bool
    attention_bias: bool
    tie_word_embeddings: bool

    @staticmethod
    def from_hf(cfg: dict[str, Any]) -> DeepseekV3Config:
        if cfg.get("hidden_act", "silu") != "silu":
            raise CheckpointError(f"hidden_act {cfg['hidden_act']!r} is not supported (only 'silu')")
        if (
            cfg.get("scoring_func", "sigmoid") != "sigmoid"
            or cfg.get("topk_method", "noaux_tc") != "noaux_tc"
        ):
            raise CheckpointError(
                "only DeepSeek-V3 routing is supported (scoring_func sigmoid, topk_method noaux_tc)"
            )
        if cfg.get("moe_layer_freq", 1) != 1:
            raise CheckpointError(f"moe_layer_freq {cfg['moe_layer_freq']} is not supported (only 1)")
        rope = rope_parameters_of(cfg)
        if rope["rope_type"] == "yarn" and rope.get("factor") is None:
            rope["factor"] = cfg["max_position_embeddings"] / rope["original_max_position_embeddings"]
        return DeepseekV3Config(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=cfg["num_attention_heads"],
            q_lora_rank=cfg.get("q_lora_rank"),
            kv_lora_rank=cfg["kv_lora_rank"],
            qk_nope_head_dim=cfg["qk_nope_head_dim"],
            qk_rope_head_dim=cfg["qk_rope_head_dim"],
            v_head_dim=cfg["v_head_dim"],
            first_k_dense_replace=cfg.get("first_k_dense_replace", 0),
            moe_intermediate_size=cfg["moe_intermediate_size"],
            n_shared_experts=cfg.get("n_shared_experts") or 0,
            routing=Routing(
                num_experts=cfg["n_routed_experts"],
                top_k=cfg["num_experts_per_tok"],
                n_group=cfg.get("n_group") or 1,
                topk_group=cfg.get("topk_group") or 1,
                norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
                routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
            ),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope=rope,
            rope_interleave=bool(cfg.get("rope_interleave", True)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        )

    @property
    def softmax_scale(self) -> float:
        scale = (self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5
        mscale_all_dim = self.rope.get("mscale_all_dim")
        if self.rope["rope_type"] != "default" and mscale_all_dim:
            factor = self.rope["factor"]
            mscale = 1.0 if factor <= 1 else 0.1 * mscale_all_dim * math.log(factor) + 1.0
            scale *= mscale * mscale
        return scale


class DeepseekV3Block:
    """One decoder layer (`model.layers.{layer}.*`), sharded for `tp`; also the MTP module's block."""

    def __init__(
        self, reader: CheckpointReader, layer: int, cfg: DeepseekV3Config, tp: TPGroup, dtype, device
    ):
        p = f"model.layers.{layer}."
        a = p + "self_attn."
        h0, h1 = tp.even_range(cfg.num_heads, "num_attention_heads")
        dn, r, dv, lat = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
        self.num_heads, self.tp, self.eps, self.cfg = h1 - h0, tp, cfg.rms_norm_eps, cfg
        self.adds_residual = tp.rank == 0  # row-parallel partial sums carry the residual once
        self.scale = cfg.softmax_scale
        qk = dn + r
        # q rows of this rank's heads, each [nope | rope]; rope rows paired for `layers.rope`.
        q_rows = torch.arange(self.num_heads * qk).view(self.num_heads, qk)
        kv_a_rows = torch.arange(lat + r)
        if not cfg.rope_interleave:
            q_rows[:, dn:] = q_rows[:, dn:][:, interleave_rotary_rows(1, r)]
            kv_a_rows[lat:] = kv_a_rows[lat:][interleave_rotary_rows(1, r)]
        # One matmul reads norm(h): q_a (replicated) or this rank's q_proj rows, then kv_a (replicated).
        if cfg.q_lora_rank:
            q_part, q_width = (a + "q_a_proj", 0, cfg.q_lora_rank), cfg.q_lora_rank
            q_order = torch.arange(q_width)
        else:
            q_part, q_width = (a + "q_proj", h0 * qk, h1 * qk), self.num_heads * qk
            q_order = q_rows.reshape(-1)
        parts = [q_part, (a + "kv_a_proj_with_mqa", 0, lat + r)]
        order = torch.cat([q_order, q_width + kv_a_rows])
        input_norm = reader.read(p + "input_layernorm.weight", dtype).to(device)
        bias = None
        if cfg.attention_bias and cfg.q_lora_rank:
            bias = read_column(reader, [(n + ".bias", s, e) for n, s, e in parts], dtype, device)[order]
        weight = read_column(reader, [(n + ".weight", s, e) for n, s, e in parts], dtype, device)[order]
        self.down = Linear(fold_norm(weight, input_norm), bias)
        self.widths = [q_width, lat, r]
        self.q_b = None
        if cfg.q_lora_rank:
            q_b = reader.read(a + "q_b_proj.weight", dtype, dim=0, start=h0 * qk, stop=h1 * qk).to(device)
            q_a_norm = reader.read(a + "q_a_layernorm.weight", dtype).to(device)
            self.q_b = Linear(fold_norm(q_b[q_rows.reshape(-1)], q_a_norm))
        self.kv_norm = RMSNorm(reader.read(a + "kv_a_layernorm.weight", dtype).to(device), LATENT_NORM_EPS)
        kv_b = reader.read(a + "kv_b_proj.weight", dtype, dim=0, start=h0 * (dn + dv), stop=h1 * (dn + dv))
        kv_b = kv_b.to(device).view(self.num_heads, dn + dv, lat)
        self.w_uk = kv_b[:, :dn].contiguous()  # [heads, dn, L]: q_lat = q_nope @ W_UK
        self.w_uv_t = kv_b[:, dn:].transpose(1, 2).contiguous()  # [heads, L, dv]
        o_bias = (
            reader.read(a + "o_proj.bias", dtype).to(device) if cfg.attention_bias and tp.rank == 0 else None
        )
        self.o = Linear(read_row(reader, a + "o_proj.weight", h0 * dv, h1 * dv, dtype, device), o_bias)
        self.post_norm = RMSNorm(
            reader.read(p + "post_attention_layernorm.weight", dtype).to(device), self.eps
        )
        if layer < cfg.first_k_dense_replace:
            i0, i1 = tp.even_range(cfg.intermediate_size, "intermediate_size")
            self.mlp = SwiGLU(reader, p + "mlp.", i0, i1, dtype, device)
        else:
            self.mlp = MoE(
                reader,
                p + "mlp.",
                cfg.routing,
                cfg.moe_intermediate_size,
                cfg.n_shared_experts,
                tp,
                dtype,
                device,
            )

    def __call__(
        self,
        h: torch.Tensor,  # [T, H] residual stream
        rotation: torch.Tensor,  # [T, 1, R/2] complex
        rows: torch.Tensor,  # [T] cache rows to write
        plan: AttentionPlan,
        kv: tuple[torch.Tensor, torch.Tensor],  # c_kv [rows, L], k_pe [rows, R]
    ) -> torch.Tensor:
        t, heads, cfg = h.shape[0], self.num_heads, self.cfg
        q, c_kv, k_pe = self.down.scaled(h, rms_scale(h, self.eps)).split(self.widths, dim=1)
        if self.q_b is not None:
            q = self.q_b.scaled(q, rms_scale(q, LATENT_NORM_EPS))  # q_a_layernorm folded in
        q_nope, q_pe = q.view(t, heads, -1).split([cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], dim=2)
        q_pe = RotaryEmbedding.apply(q_pe, rotation)
        c_cache, pe_cache = kv
        c_cache.index_copy_(0, rows, self.kv_norm(c_kv))
        pe_cache.index_copy_(0, rows, RotaryEmbedding.apply(k_pe[:, None], rotation)[:, 0])
        q_lat = torch.bmm(q_nope.transpose(0, 1), self.w_uk).transpose(0, 1)  # [T, heads, L]
        latent = latent_attention(q_lat, q_pe, c_cache, pe_cache, plan, self.scale)  # [T, heads, L]
        attn = torch.bmm(latent.transpose(0, 1), self.w_uv_t).transpose(0, 1).reshape(t, -1)  # [T, heads dv]
        h = self.tp.all_reduce(self.o(attn, h if self.adds_residual else None))
        return self.tp.all_reduce(self.mlp(self.post_norm(h), h if self.adds_residual else None))


@register_architecture("DeepseekV3ForCausalLM", "deepseek_v3")
class DeepseekV3Model:
    def __init__(
        self, cfg: DeepseekV3Config, reader: CheckpointReader, tp: TPGroup, dtype, device, max_positions
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
        self.head = VocabParallelHead(
            fold_norm(head.to(device), self.norm.weight), per_rank, cfg.vocab_size, tp
        )
        self.blocks = [DeepseekV3Block(reader, i, cfg, tp, dtype, device) for i in range(cfg.num_layers)]
        self.rope = RotaryEmbedding(cfg.qk_rope_head_dim, cfg.rope, max_positions, device)

    @classmethod
    def from_checkpoint(cls, reader, tp, dtype, device, max_positions) -> DeepseekV3Model:
        return cls(
            DeepseekV3Config.from_hf(reader.config), maybe_fp8(reader), tp, dtype, device, max_positions
        )

    def kv_spec(self) -> KVSpec:
        """The compressed cache: latent + rope key per token per layer, the same on every TP rank."""
        buffers = (("c_kv", (self.cfg.kv_lora_rank,)), ("k_pe", (self.cfg.qk_rope_head_dim,)))
        return KVSpec(num_layers=self.num_layers, buffers=buffers, dtype=self.dtype)

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
        final = self.norm(h) if capture.final or self.num_layers in capture.layer_inputs else None
        if self.num_layers in capture.layer_inputs:
            layer_inputs[self.num_layers] = final  # MTP's input: the state the LM head reads
        rows = h if batch.logits_rows is None else h[batch.logits_rows]
        return ForwardOutput(
            logits=self.head(rows, rms_scale(rows, self.cfg.rms_norm_eps)),  # final norm folded in
            final_hidden=final if capture.final else None,
            layer_inputs=layer_inputs,
        )
