"""Triton kernel for `paged_attention`: one program per (query token, query head).

Each program loads its query row, then walks its sequence's visible slots in tiles of
BLOCK_N: the block table maps each slot to its cache row, K and V rows are read straight
from the cache, the visibility test is the two ranges of `paged_attention` (causal limit,
tree ancestors), and the softmax is accumulated online (running max and sum), so the cost is
one pass over the visible K/V whatever the batch's mix of prefill chunks, decodes and trees.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from outrider.kernels.backend import next_power_of_2


@triton.jit
def _paged_attention_kernel(
    q_ptr,  # [T, H_q, D]
    k_ptr,  # [rows, H_kv, D]
    v_ptr,  # [rows, H_kv, DV]
    out_ptr,  # [T, H_q, DV] float32
    tables_ptr,  # [B, MAX_BLOCKS] int64
    seq_ptr,  # [T] int64
    limit_ptr,  # [T] int64
    tree_start_ptr,  # [T] int64
    tree_mask_ptr,  # [T, W] int8 (unused when W == 0)
    scale,
    NUM_HEADS,
    GROUP,
    D,
    DV,
    W,
    MAX_BLOCKS,
    BLOCK_SIZE,
    stride_qt,
    stride_qh,
    stride_kr,
    stride_kh,
    stride_vr,
    stride_vh,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    kv_head = h // GROUP
    seq = tl.load(seq_ptr + t)
    limit = tl.load(limit_ptr + t)
    tree_start = tl.load(tree_start_ptr + t)
    end = limit
    if W > 0:
        end = tl.maximum(limit, tree_start + W)
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    q = tl.load(q_ptr + t * stride_qt + h * stride_qh + d, mask=d < D, other=0.0).to(tl.float32)
    m_i = tl.full([1], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([1], dtype=tl.float32)
    acc = tl.zeros([BLOCK_DV], dtype=tl.float32)
    for start in range(0, end, BLOCK_N):
        slots = start + tl.arange(0, BLOCK_N)
        in_range = slots < end
        block = tl.load(tables_ptr + seq * MAX_BLOCKS + slots // BLOCK_SIZE, mask=in_range, other=0)
        rows = block * BLOCK_SIZE + slots % BLOCK_SIZE
        visible = slots < limit
        if W > 0:
            offset = slots - tree_start
            inside = (offset >= 0) & (offset < W) & in_range
            picked = tl.load(tree_mask_ptr + t * W + offset, mask=inside, other=0)
            visible = visible | (inside & (picked != 0))
        k = tl.load(
            k_ptr + rows[:, None] * stride_kr + kv_head * stride_kh + d[None, :],
            mask=in_range[:, None] & (d[None, :] < D),
            other=0.0,
        ).to(tl.float32)
        scores = tl.sum(k * q[None, :], axis=1) * scale
        scores = tl.where(visible, scores, -1.0e30)
        m_new = tl.maximum(m_i, tl.max(scores, axis=0))
        p = tl.where(visible, tl.exp(scores - m_new), 0.0)
        alpha = tl.exp(m_i - m_new)
        v = tl.load(
            v_ptr + rows[:, None] * stride_vr + kv_head * stride_vh + dv[None, :],
            mask=in_range[:, None] & (dv[None, :] < DV),
            other=0.0,
        ).to(tl.float32)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        m_i = m_new
    out = acc / l_i
    tl.store(out_ptr + (t * NUM_HEADS + h) * DV + dv, out, mask=dv < DV)


def paged_attention_triton(
    q, k_cache, v_cache, block_tables, block_size, token_seq, limit, tree_start, tree_mask, scale
) -> torch.Tensor:
    """Same contract as `paged_attention.paged_attention`."""
    t, num_heads, head_dim = q.shape
    dv = v_cache.shape[-1]
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError("paged attention's Triton kernel needs the last dimension contiguous")
    out = torch.empty(t, num_heads, dv, dtype=torch.float32, device=q.device)
    if t == 0:
        return out.to(q.dtype)
    width = 0 if tree_mask is None else tree_mask.shape[1]
    mask = (
        tree_mask.to(torch.int8).contiguous() if tree_mask is not None else limit
    )  # any pointer when W == 0
    tables = block_tables.to(torch.int64).contiguous()
    _paged_attention_kernel[(t, num_heads)](
        q, k_cache, v_cache, out, tables,
        token_seq.to(torch.int64).contiguous(), limit.to(torch.int64).contiguous(),
        tree_start.to(torch.int64).contiguous(), mask, scale,
        num_heads, num_heads // k_cache.shape[1], head_dim, dv, width, tables.shape[1], block_size,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        BLOCK_N=64, BLOCK_D=next_power_of_2(head_dim), BLOCK_DV=next_power_of_2(dv),
    )  # fmt: skip
    return out.to(q.dtype)
