"""Move the accepted path's KV rows into contiguous slots after verification.

During verify, node l of a sequence's tree is written at slot root_slot + l (the root, the
last committed token, at root_slot = context_len for a per-sequence cache). Afterwards the
k-th accepted node (k = 1..num_accepted, local index l_k) must sit at root_slot + k:

    slot:   root  +1   +2   +3   +4   +5          accepted path: 0 -> 2 -> 5
    before: [r]  [a]  [b]  [c]  [d]  [e]
    after:  [r]  [b]  [e]  ...  (rest is garbage, overwritten next round)

Copies run in path order: l_k >= k and l_k increases along the path, so the destination of
step k is never the source of a later step even though the ranges overlap.

The slot dimension of `cache` is explicit, so one function serves [layers, 2, slots, heads,
head_dim] caches, MLA latent caches [layers, slots, latent] and any other layout; a paged
cache maps its block table onto the same flat slot index.
"""

from __future__ import annotations

import torch

from outrider.kernels.backend import Backend, use_triton


def compact_kv(
    cache: torch.Tensor,  # [..., num_slots, ...] any dtype, slot dimension = slot_dim; mutated
    accepted_node_ids: torch.Tensor,  # [batch, max_accepted] int64; local nodes, -1 pad (VerifyOutput)
    root_slots: torch.Tensor,  # [batch] int64; slot holding each tree's root
    slot_dim: int,
    backend: Backend | None = None,
) -> None:
    slot_dim = slot_dim % cache.dim()
    if accepted_node_ids.numel() == 0:
        return
    if use_triton(backend, cache.device):
        from outrider.kernels.kv_compaction_triton import compact_kv_triton

        compact_kv_triton(cache, accepted_node_ids, root_slots, slot_dim)
        return
    step = torch.arange(1, accepted_node_ids.shape[1] + 1, device=cache.device)
    moved = (accepted_node_ids >= 0) & (accepted_node_ids != step)
    src = (root_slots[:, None] + accepted_node_ids)[moved]
    dst = (root_slots[:, None] + step)[moved]
    # index_select copies first, so overlapping source and destination slots are safe.
    cache.index_copy_(slot_dim, dst, cache.index_select(slot_dim, src))
