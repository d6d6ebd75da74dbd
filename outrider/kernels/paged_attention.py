"""Attention of a ragged batch of query tokens over a paged KV cache, trees included.

Every query token t belongs to one sequence (`token_seq[t]`) whose cache slots are mapped to
rows by its block table (row = table[slot // block_size] * block_size + slot % block_size).
Which slots t sees is two ranges, enough for prefill chunks, decodes and trees alike:

    slot s visible  <=>  s < limit[t]                                        (causal part)
                    or   tree_start[t] <= s < tree_start[t] + W
                         and tree_mask[t, s - tree_start[t]]                 (its tree ancestors)

    prefill / chain token i after `context` cached tokens:   limit = context + i + 1
    tree node i (tree slots start at `context`):            limit = context, tree_mask row =
                                                            its ancestors and itself

Grouped-query attention: query head h reads KV head h // (H_q / H_kv). The torch reference
gathers each token's visible slots; the Triton kernel (`paged_attention_triton`) walks the
block table in tiles with an online softmax, one program per (token, head), reading K/V
straight from the cache, no gather and no padding, so one launch serves the whole batch.
"""

from __future__ import annotations

import torch

from outrider.kernels.backend import Backend, use_triton


def paged_attention(
    q: torch.Tensor,  # [T, H_q, D]
    k_cache: torch.Tensor,  # [rows, H_kv, D]
    v_cache: torch.Tensor,  # [rows, H_kv, D_v]
    block_tables: torch.Tensor,  # [B, max_blocks] int64
    block_size: int,
    token_seq: torch.Tensor,  # [T] int64; the sequence (row of block_tables) of each token
    limit: torch.Tensor,  # [T] int64; slots 0 .. limit - 1 are visible
    tree_start: torch.Tensor,  # [T] int64; first slot tree_mask describes
    tree_mask: torch.Tensor | None,  # [T, W] bool; None = no tree part
    scale: float | None = None,
    backend: Backend | None = None,
) -> torch.Tensor:
    """Returns [T, H_q, D_v]."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if use_triton(backend, q.device):
        from outrider.kernels.paged_attention_triton import paged_attention_triton

        return paged_attention_triton(
            q, k_cache, v_cache, block_tables, block_size, token_seq, limit, tree_start, tree_mask, scale
        )
    return _paged_attention_reference(
        q, k_cache, v_cache, block_tables, block_size, token_seq, limit, tree_start, tree_mask, scale
    )


def visible_slots(
    limit: torch.Tensor, tree_start: torch.Tensor, tree_mask: torch.Tensor | None, width: int
) -> torch.Tensor:
    """[T, width] bool: which of slots 0 .. width - 1 each token sees."""
    slot = torch.arange(width, device=limit.device)[None, :]
    visible = slot < limit[:, None]
    if tree_mask is not None:
        offset = slot - tree_start[:, None]  # [T, width]
        inside = (offset >= 0) & (offset < tree_mask.shape[1])
        picked = tree_mask.gather(1, offset.clamp(0, tree_mask.shape[1] - 1))
        visible |= inside & picked
    return visible


def _paged_attention_reference(
    q, k_cache, v_cache, block_tables, block_size, token_seq, limit, tree_start, tree_mask, scale
) -> torch.Tensor:
    t, num_heads, _ = q.shape
    group = num_heads // k_cache.shape[1]
    width = int(limit.max())
    if tree_mask is not None:
        width = max(width, int((tree_start + tree_mask.shape[1]).max()))
    slot = torch.arange(width, device=q.device)
    table = block_tables[token_seq]  # [T, max_blocks]
    blocks = table.gather(1, (slot // block_size).clamp(max=table.shape[1] - 1).expand(t, -1))
    rows = blocks * block_size + slot % block_size  # [T, width]
    k = k_cache[rows].repeat_interleave(group, dim=2).float()  # [T, width, H_q, D]
    v = v_cache[rows].repeat_interleave(group, dim=2).float()
    scores = torch.einsum("thd,tshd->ths", q.float(), k) * scale  # [T, H_q, width]
    visible = visible_slots(limit, tree_start, tree_mask, width)  # [T, width]
    scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
    return torch.einsum("ths,tshd->thd", scores.softmax(-1), v).to(q.dtype)
