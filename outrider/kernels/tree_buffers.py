"""Tree topology turned into the buffers a verify forward pass needs, once per round.

For each flattened node i of tree b (local index l, so i = cu_num_draft_tokens[b] + l):

    depths[i]       = number of ancestors of l (the root has depth 0)
    positions[i]    = context_lens[b] + depths[i]            (RoPE position)
    tree_mask[i, k] = local node k is l or an ancestor of l  (columns past the tree: False)

`retrieve_paths[b, j]` lists the local nodes from the root to the j-th leaf of tree b (leaves
in ascending local index), padded with -1. Context attention is implied by the mask and added
by `tree_attention_mask`, which lays it out against a KV cache indexed by absolute slot.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from outrider.kernels.backend import Backend, use_triton


@dataclass
class TreeBuffers:
    positions: torch.Tensor  # [total_nodes] int64; context_len + depth
    depths: torch.Tensor  # [total_nodes] int64
    tree_mask: torch.Tensor  # [total_nodes, max_num_nodes] bool; ancestors-or-self, local columns
    retrieve_paths: torch.Tensor  # [batch, max_leaves, max_depth + 1] int64; local nodes, -1 pad
    max_num_nodes: int
    max_depth: int


def build_tree_buffers(
    parents: torch.Tensor,  # [total_nodes] int64; local, -1 at roots
    cu_num_draft_tokens: torch.Tensor,  # [batch + 1] int64
    context_lens: torch.Tensor,  # [batch] int64; tokens already in the KV cache
    backend: Backend | None = None,
) -> TreeBuffers:
    sizes = cu_num_draft_tokens[1:] - cu_num_draft_tokens[:-1]
    max_num_nodes = int(sizes.max())
    if use_triton(backend, parents.device):
        from outrider.kernels.tree_buffers_triton import tree_buffers_triton

        depths, ancestors_or_self, paths = tree_buffers_triton(parents, cu_num_draft_tokens, max_num_nodes)
    else:
        depths, ancestors_or_self, paths = _tree_buffers_reference(
            parents, cu_num_draft_tokens, max_num_nodes
        )
    # Trim the [batch, max_num_nodes, max_num_nodes] path table to the leaves and depth used.
    max_leaves = int((paths[:, :, 0] >= 0).sum(1).max())
    max_depth = int(depths.max())
    batch_of_node = torch.repeat_interleave(torch.arange(sizes.numel(), device=parents.device), sizes)
    return TreeBuffers(
        positions=context_lens.to(torch.int64)[batch_of_node] + depths,
        depths=depths,
        tree_mask=ancestors_or_self,
        retrieve_paths=paths[:, :max_leaves, : max_depth + 1].contiguous(),
        max_num_nodes=max_num_nodes,
        max_depth=max_depth,
    )


def _tree_buffers_reference(
    parents: torch.Tensor, cu_num_draft_tokens: torch.Tensor, max_num_nodes: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns depths [total_nodes], tree_mask [total_nodes, N], paths [batch, N, N] (N = max nodes)."""
    device, n = parents.device, max_num_nodes
    starts, sizes = cu_num_draft_tokens[:-1], cu_num_draft_tokens[1:] - cu_num_draft_tokens[:-1]
    batch = sizes.numel()
    local = torch.arange(n, device=device)
    valid = local < sizes[:, None]  # [batch, N]
    flat = (starts[:, None] + local).clamp(max=max(parents.numel() - 1, 0))
    par = torch.where(valid, parents[flat], -1)  # [batch, N]
    rows = torch.arange(batch, device=device)
    # anc[b, l, k]: k is l or an ancestor of l. Parents precede children, so one pass in
    # index order sees every parent's row complete before its children copy it.
    anc = torch.eye(n, dtype=torch.bool, device=device).expand(batch, n, n) & valid[:, :, None]
    anc = anc.clone()
    for i in range(1, n):
        row = anc[rows, par[:, i].clamp(min=0)]
        row[:, i] = True
        anc[:, i] = row & valid[:, i, None]
    depths = anc.sum(-1) - 1  # [batch, N]
    has_child = (par[:, :, None] == local).any(1)  # [batch, N]
    is_leaf = valid & ~has_child
    leaf_rank = is_leaf.cumsum(-1) - 1
    step = anc.cumsum(-1) - 1  # position of ancestor k on the path to l
    paths = torch.full((batch, n, n), -1, dtype=torch.int64, device=device)
    b, leaf, node = torch.nonzero(anc & is_leaf[:, :, None], as_tuple=True)
    paths[b, leaf_rank[b, leaf], step[b, leaf, node]] = node
    return depths[valid], anc[valid], paths


def tree_attention_mask(
    tree_mask: torch.Tensor,  # [total_nodes, max_num_nodes] bool
    cu_num_draft_tokens: torch.Tensor,  # [batch + 1] int64
    context_lens: torch.Tensor,  # [batch] int64
    num_kv_slots: int,
) -> torch.Tensor:
    """Boolean SDPA mask [batch, 1, max_num_nodes, num_kv_slots]; True = may attend.

    Layout: the tree is padded per sequence to max_num_nodes query rows, and each sequence's
    KV cache holds slot s = absolute position s for the context, with tree node l written at
    slot context_len + l (the root at context_len):

        slots:      0 .. context_len-1 | context_len + 0 .. context_len + n-1 | rest
        query l:    all True           | tree_mask[l, :n]                     | False

    Padding rows (l >= n) attend to slot 0 only, so SDPA never sees an all-False row (which
    would give NaN); their outputs are garbage and must be ignored.
    """
    device = tree_mask.device
    n = tree_mask.shape[1]
    starts, sizes = cu_num_draft_tokens[:-1], cu_num_draft_tokens[1:] - cu_num_draft_tokens[:-1]
    batch = sizes.numel()
    local = torch.arange(n, device=device)
    valid = local < sizes[:, None]  # [batch, N]
    flat = (starts[:, None] + local).clamp(max=tree_mask.shape[0] - 1)
    padded_tree = tree_mask[flat] & valid[:, :, None] & valid[:, None, :]  # [batch, N, N]
    slots = torch.arange(num_kv_slots, device=device)
    node = slots - context_lens[:, None]  # [batch, S]; local node held by each slot
    in_tree = (node >= 0) & (node < n)
    gather = node.clamp(0, n - 1)[:, None, :].expand(batch, n, num_kv_slots)
    mask = padded_tree.gather(2, gather) & in_tree[:, None, :]
    mask |= (slots < context_lens[:, None])[:, None, :]
    mask[:, :, 0] |= ~valid
    return mask[:, None]
