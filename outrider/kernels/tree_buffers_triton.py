"""Triton kernel for `build_tree_buffers`: one program per tree.

The ancestor matrix of a tree lives in registers as a [BLOCK_N, BLOCK_N] tile; rows are
filled in local index order, so every parent row is final before its children copy it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from outrider.kernels.backend import next_power_of_2


@triton.jit
def _tree_buffers_kernel(
    parents_ptr,  # [total_nodes] int64; local, -1 at roots
    cu_num_draft_tokens_ptr,  # [batch + 1] int64
    depths_ptr,  # [total_nodes] int64, mutable
    tree_mask_ptr,  # [total_nodes, MAX_NODES] uint8 (bool), mutable
    paths_ptr,  # [batch, MAX_NODES, MAX_NODES] int64, mutable, prefilled with -1
    MAX_NODES: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    b = tl.program_id(0)
    start = tl.load(cu_num_draft_tokens_ptr + b)
    n = (tl.load(cu_num_draft_tokens_ptr + b + 1) - start).to(tl.int32)
    idx = tl.arange(0, BLOCK_N)
    rows = idx[:, None]
    cols = idx[None, :]
    par = tl.load(parents_ptr + start + idx, mask=idx < n, other=-1).to(tl.int32)

    anc = ((rows == cols) & (rows < n)).to(tl.int32)  # [BLOCK_N, BLOCK_N] ancestors-or-self
    for i in range(1, n):
        parent = tl.sum(tl.where(idx == i, par, 0), axis=0)
        parent_row = tl.max(tl.where(rows == parent, anc, 0), axis=0)  # [BLOCK_N] over columns
        new_row = tl.maximum(parent_row, (idx == i).to(tl.int32))
        anc = tl.where(rows == i, new_row[None, :], anc)

    depth = tl.sum(anc, axis=1) - 1
    tl.store(depths_ptr + start + idx, depth.to(tl.int64), mask=idx < n)
    row_ptr = tree_mask_ptr + (start + rows) * MAX_NODES + cols
    tl.store(row_ptr, anc.to(tl.uint8), mask=(rows < n) & (cols < MAX_NODES))

    has_child = tl.max(tl.where(par[:, None] == cols, 1, 0), axis=0)  # [BLOCK_N]
    is_leaf = ((idx < n) & (has_child == 0)).to(tl.int32)
    leaf_rank = tl.cumsum(is_leaf, axis=0) - 1
    step = tl.cumsum(anc, axis=1) - 1  # position of ancestor k on the path to leaf l
    path_ptr = paths_ptr + b * MAX_NODES * MAX_NODES + leaf_rank[:, None] * MAX_NODES + step
    on_path = (anc != 0) & (is_leaf[:, None] != 0)
    tl.store(path_ptr, (cols + rows * 0).to(tl.int64), mask=on_path)


def tree_buffers_triton(
    parents: torch.Tensor, cu_num_draft_tokens: torch.Tensor, max_num_nodes: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Same contract as `tree_buffers._tree_buffers_reference`."""
    total, batch = parents.numel(), cu_num_draft_tokens.numel() - 1
    depths = torch.empty(total, dtype=torch.int64, device=parents.device)
    tree_mask = torch.zeros(total, max_num_nodes, dtype=torch.uint8, device=parents.device)
    paths = torch.full((batch, max_num_nodes, max_num_nodes), -1, dtype=torch.int64, device=parents.device)
    _tree_buffers_kernel[(batch,)](
        parents.contiguous(),
        cu_num_draft_tokens.contiguous(),
        depths,
        tree_mask,
        paths,
        MAX_NODES=max_num_nodes,
        BLOCK_N=next_power_of_2(max_num_nodes),
    )
    return depths, tree_mask.view(torch.bool), paths
