"""Attention over a ragged batch against the KV cache, with SDPA and explicit masks.

Each sequence b attends to its cache extent rows [kv_start, kv_start + kv_len): the committed
context, then its new tokens (already written there by the caller). What it may see is
decided once per forward in `plan_attention`, not per layer:

    n == 1, no mask           decode: every row visible, no mask at all
    mask given                tree verify: [n, kv_len] bool from `kernels.tree_attention_mask`
    context 0, no mask        prefill of a fresh sequence: SDPA's own causal flag
    context > 0, no mask      chunked prefill / chain: causal shifted by the context length

The cache is [rows, H_kv, D] per layer, so a sequence's keys are a strided *view*, never a
copy. Grouped-query attention: for one query token the H_q query heads are viewed as
[H_kv, group, D] (a free reshape) so SDPA sees plain multi-head attention with `group`
queries per KV head; for longer chunks SDPA's `enable_gqa` broadcasts KV heads itself.
Inputs are 4-D ([1, heads, tokens, D]): with 3-D inputs CPU SDPA takes its slow math path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from outrider.target_worker.batch import ForwardBatch


@dataclass(frozen=True)
class SeqAttention:
    q_start: int  # rows [q_start, q_stop) of the flattened [T] tokens
    q_stop: int
    kv_start: int  # cache rows [kv_start, kv_stop)
    kv_stop: int
    mask: torch.Tensor | None  # [n, kv_len] bool, True = attend; None with causal/decode
    causal: bool  # SDPA is_causal (n > 1, nothing cached before)


def plan_attention(batch: ForwardBatch) -> list[SeqAttention]:
    plan = []
    cu = batch.cu_seqlens
    for b, (kv_start, kv_len, mask) in enumerate(
        zip(batch.kv_starts, batch.kv_lens, batch.attn_masks, strict=True)
    ):
        n = cu[b + 1] - cu[b]
        causal = False
        if mask is None and n > 1:
            if kv_len == n:
                causal = True
            else:
                # Query i (absolute row kv_len - n + i) sees rows 0 .. kv_len - n + i.
                mask = torch.ones(n, kv_len, dtype=torch.bool, device=batch.input_ids.device)
                mask = mask.tril(kv_len - n)
        plan.append(SeqAttention(cu[b], cu[b + 1], kv_start, kv_start + kv_len, mask, causal))
    return plan


def ragged_attention(
    q: torch.Tensor,  # [T, H_q, D]
    k_cache: torch.Tensor,  # [rows, H_kv, D]; this layer's keys, new tokens already written
    v_cache: torch.Tensor,  # [rows, H_kv, D_v]
    plan: list[SeqAttention],
    scale: float | None = None,
) -> torch.Tensor:
    """Returns [T, H_q, D_v]."""
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[1]
    group = num_heads // num_kv_heads
    single = len(plan) == 1
    out = None if single else q.new_empty(q.shape[0], num_heads, v_cache.shape[-1])
    for seq in plan:
        k = k_cache[seq.kv_start : seq.kv_stop].transpose(0, 1)[None]  # [1, H_kv, kv_len, D]
        v = v_cache[seq.kv_start : seq.kv_stop].transpose(0, 1)[None]
        n = seq.q_stop - seq.q_start
        if n == 1 and seq.mask is None:
            # One query: heads sharing a KV head become `group` query rows of that head.
            qs = q[seq.q_start].view(1, num_kv_heads, group, -1)
            o = F.scaled_dot_product_attention(qs, k, v, scale=scale).reshape(1, num_heads, -1)
        else:
            qs = q[seq.q_start : seq.q_stop].transpose(0, 1)[None]  # [1, H_q, n, D]
            o = F.scaled_dot_product_attention(
                qs, k, v, attn_mask=seq.mask, is_causal=seq.causal, scale=scale, enable_gqa=group > 1
            )[0].transpose(0, 1)  # [n, H_q, D_v]
        if single:
            return o
        out[seq.q_start : seq.q_stop] = o
    return out
