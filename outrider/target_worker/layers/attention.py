"""Attention over a ragged batch against the KV cache: a few batched SDPA calls per layer,
however many sequences the batch holds.

Each sequence b attends to the cache rows of its slots 0 .. kv_len - 1
(`ForwardBatch.kv_index`, contiguous extent or paged block table alike): the committed
context, then its new tokens (already written there by the caller). What it may see is
decided once per forward in `plan_attention`, not per layer:

    n == 1, no mask           decode: every slot visible
    mask given                tree verify: [n, kv_len] bool from `kernels.tree_attention_mask`
    no mask                   prefill chunk / chain: causal, shifted by the context length

Sequences are grouped by query length (1, 2, 3-4, 5-8, ... tokens), and each group is one
padded SDPA call: queries [G, H_q, n_max, D] gathered from the flat batch, keys and values
[G, H_kv, kv_max, D] gathered whole blocks at a time through the block tables (paged; 2-3x
faster on CPU than row by row) or through `kv_index` (extents), one bool mask [G, 1, n_max, kv_max] for
causality, trees and padding (built once per forward, shared by every layer). Grouping bounds
the padding waste at 2x while the number of calls stays a handful (the distinct length
classes), never one per sequence. Decode groups fold the H_q query heads into [H_kv, group]
rows of their KV head (plain multi-head attention, no GQA broadcast); inputs are 4-D (with
3-D inputs CPU SDPA takes its slow math path).

On CUDA with Triton, a paged batch runs instead as one launch of `kernels.paged_attention`
(every token, no padding, K/V read in place through the block tables); the plan carries
the per-token ranges it needs (`PagedTokens`). MLA keeps the grouped path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from outrider.kernels.backend import use_triton
from outrider.kernels.paged_attention import paged_attention
from outrider.target_worker.batch import ForwardBatch


@dataclass(frozen=True)
class AttentionGroup:
    """Sequences of one query-length class, padded to one SDPA call."""

    q_index: torch.Tensor  # [G, n_max] int64 rows of the flat [T] queries (padding repeats a real one)
    kv_index: torch.Tensor | None  # [G, kv_max] int64 cache rows (padding: a real row, masked out)
    kv_blocks: torch.Tensor | None  # paged instead: [G, kv_max / block_size] int64 cache blocks
    mask: torch.Tensor | None  # [G, 1, n_max, kv_max] bool, True = attend; None = all visible
    causal: bool  # SDPA's own causal flag suffices (fresh prefills of equal length, no padding)
    out_rows: torch.Tensor | None  # [T_g] rows of [T] the real queries fill; None = all of [T] in order
    out_take: torch.Tensor | None  # [T_g] their positions in the group's flattened [G * n_max]
    block_size: int = 0
    kv_len: int = 0  # kv_max: slots gathered per sequence (whole blocks are read, then cut to it)
    kv_start: int = -1  # one sequence whose slots are consecutive rows from here: read as a view

    def gather(self, cache: torch.Tensor) -> torch.Tensor:
        """[rows, *shape] cache -> [G, kv_max, *shape]: each sequence's slots, in order."""
        if self.kv_start >= 0:
            return cache[self.kv_start : self.kv_start + self.kv_len].unsqueeze(0)
        if self.kv_blocks is None:
            return cache[self.kv_index]
        g, num_blocks = self.kv_blocks.shape
        size = self.block_size
        blocks = cache[: cache.shape[0] // size * size].view(-1, size * cache[0].numel())
        picked = blocks.index_select(0, self.kv_blocks.reshape(-1))  # [G * blocks, size * row]
        return picked.view(g, num_blocks * size, *cache.shape[1:])[:, : self.kv_len]


@dataclass(frozen=True)
class PagedTokens:
    """Per query token, what `kernels.paged_attention` needs (GPU, paged batches): one launch."""

    block_tables: torch.Tensor  # [B, max_blocks] int64
    block_size: int
    token_seq: torch.Tensor  # [T] int64
    limit: torch.Tensor  # [T] int64; causal part: slots 0 .. limit - 1
    tree_start: torch.Tensor  # [T] int64
    tree_mask: torch.Tensor | None  # [T, max tree size] bool; None without trees


@dataclass(frozen=True)
class AttentionPlan:
    groups: tuple[AttentionGroup, ...]
    num_tokens: int
    paged: PagedTokens | None = None  # set when the paged Triton kernel runs the batch


def _length_class(n: int) -> int:
    """1, 2, 3-4, 5-8, ... : sequences whose query counts share a class share a call."""
    return (n - 1).bit_length()


def plan_attention(batch: ForwardBatch) -> AttentionPlan:
    cu = batch.cu_seqlens
    sizes = [cu[b + 1] - cu[b] for b in range(len(cu) - 1)]
    classes: dict[int, list[int]] = {}
    for b, n in enumerate(sizes):
        classes.setdefault(_length_class(n), []).append(b)
    groups = tuple(_plan_group(batch, members, sizes) for _, members in sorted(classes.items()))
    paged = None
    if batch.block_tables is not None and use_triton(None, batch.cache_rows.device):
        paged = _paged_tokens(batch, sizes)
    return AttentionPlan(groups, batch.num_tokens, paged)


def _paged_tokens(batch: ForwardBatch, sizes: list[int]) -> PagedTokens:
    device = batch.cache_rows.device
    n = torch.tensor(sizes)
    context = torch.tensor(batch.kv_lens) - n  # [B]
    token_seq = torch.repeat_interleave(torch.arange(len(sizes)), n)  # [T]
    index = torch.arange(batch.num_tokens) - (torch.cumsum(n, 0) - n)[token_seq]  # i within its sequence
    is_tree = torch.tensor([m is not None for m in batch.attn_masks])
    limit = context[token_seq] + torch.where(is_tree[token_seq], 0, index + 1)
    tree_mask = None
    if bool(is_tree.any()):
        width = max(sizes[b] for b in range(len(sizes)) if batch.attn_masks[b] is not None)
        tree_mask = torch.zeros(batch.num_tokens, width, dtype=torch.bool)
        for b, mask in enumerate(batch.attn_masks):
            if mask is not None:
                start, ctx = batch.cu_seqlens[b], int(context[b])
                tree_mask[start : start + sizes[b], : sizes[b]] = mask[:, ctx:].to("cpu")
        tree_mask = tree_mask.to(device)
    return PagedTokens(
        block_tables=batch.block_tables,
        block_size=batch.block_size,
        token_seq=token_seq.to(device),
        limit=limit.to(device),
        tree_start=context[token_seq].to(device),
        tree_mask=tree_mask,
    )


def _plan_group(batch: ForwardBatch, members: list[int], sizes: list[int]) -> AttentionGroup:
    """One length class's call; Python lists until the few tensors it needs (it runs every
    forward, and per-sequence torch ops on tiny tensors would cost more than the work)."""
    device, cu = batch.cache_rows.device, batch.cu_seqlens
    n = [sizes[b] for b in members]
    kv = [batch.kv_lens[b] for b in members]
    n_max, kv_max = max(n), max(kv)
    q_index = [[cu[b] + min(i, nb - 1) for i in range(n_max)] for b, nb in zip(members, n, strict=True)]
    trees = any(batch.attn_masks[b] is not None for b in members)
    equal = all(x == n_max for x in n) and all(x == kv_max for x in kv)
    fresh = not trees and equal and kv_max == n_max  # fresh prefills of one length: SDPA's causal flag
    mask = None
    if not fresh and (n_max > 1 or not equal):
        n_t, kv_t, row = torch.tensor(n), torch.tensor(kv), torch.arange(n_max)
        # Query i (clamped to the real ones) of a chain sees slots 0 .. kv - n + i.
        last = (kv_t - n_t)[:, None] + torch.minimum(row[None, :], n_t[:, None] - 1)  # [G, n_max]
        mask = torch.arange(kv_max)[None, None, :] <= last[:, :, None]  # [G, n_max, kv_max]
        for g, b in enumerate(members):
            tree = batch.attn_masks[b]
            if tree is not None:
                m, k = tree.shape
                mask[g, :m, :k] = tree.to("cpu")
                mask[g, :m, k:] = False
                mask[g, m:] = mask[g, m - 1]
        mask = mask[:, None].to(device)
    whole = len(members) == len(sizes) and all(x == n_max for x in n)  # every token, in order
    out_rows, out_take = None, None
    if not whole:
        real = [(g, i) for g, nb in enumerate(n) for i in range(nb)]
        out_rows = torch.tensor([q_index[g][i] for g, i in real], device=device)
        out_take = torch.tensor([g * n_max + i for g, i in real], device=device)
    size, kv_index, kv_blocks, kv_start = batch.block_size, None, None, -1
    if batch.block_tables is not None:
        num_blocks = -(-kv_max // size)
        tables = batch.block_tables
        if len(members) != tables.shape[0]:
            tables = tables[torch.tensor(members, device=device)]
        kv_blocks = tables[:, :num_blocks]
        if len(members) == 1 and device.type == "cpu":  # (reading the table on a GPU would sync)
            first, *rest = kv_blocks[0].tolist()
            if rest == list(range(first + 1, first + num_blocks)):
                kv_start = first * size
    else:
        kv_index = batch.kv_index[torch.tensor(members, device=device), :kv_max]
    return AttentionGroup(
        q_index=torch.tensor(q_index, device=device),
        kv_index=kv_index,
        kv_blocks=kv_blocks,
        block_size=size,
        kv_len=kv_max,
        kv_start=kv_start,
        mask=mask,
        causal=fresh and n_max > 1,
        out_rows=out_rows,
        out_take=out_take,
    )


def ragged_attention(
    q: torch.Tensor,  # [T, H_q, D]
    k_cache: torch.Tensor,  # [rows, H_kv, D]; this layer's keys, new tokens already written
    v_cache: torch.Tensor,  # [rows, H_kv, D_v]
    plan: AttentionPlan,
    scale: float | None = None,
) -> torch.Tensor:
    """Returns [T, H_q, D_v]."""
    if plan.paged is not None:
        p = plan.paged
        return paged_attention(
            q,
            k_cache,
            v_cache,
            p.block_tables,
            p.block_size,
            p.token_seq,
            p.limit,
            p.tree_start,
            p.tree_mask,
            scale,
        )
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[1]
    group_size = num_heads // num_kv_heads
    out = None
    for group in plan.groups:
        g, n_max = group.q_index.shape
        k = group.gather(k_cache).transpose(1, 2)  # [G, H_kv, kv_max, D]
        v = group.gather(v_cache).transpose(1, 2)
        if n_max == 1:
            # One query: heads sharing a KV head become `group_size` query rows of that head.
            qs = q[group.q_index[:, 0]].view(g, num_kv_heads, group_size, -1)
            o = F.scaled_dot_product_attention(qs, k, v, attn_mask=group.mask, scale=scale)
            o = o.reshape(g, num_heads, -1)  # [G * 1, H_q, D_v]
        else:
            qs = q[group.q_index].transpose(1, 2)  # [G, H_q, n_max, D]
            o = F.scaled_dot_product_attention(
                qs, k, v, attn_mask=group.mask, is_causal=group.causal, scale=scale, enable_gqa=group_size > 1
            )
            o = o.transpose(1, 2).reshape(g * n_max, num_heads, -1)  # [G * n_max, H_q, D_v]
        if group.out_rows is None:
            return o
        if out is None:
            out = q.new_empty(plan.num_tokens, num_heads, v_cache.shape[-1])
        out[group.out_rows] = o[group.out_take]
    return out
