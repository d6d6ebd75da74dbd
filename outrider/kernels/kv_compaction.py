"""Move the accepted path's KV rows into place after verification.

During verify, node l of a sequence's tree is written at its local slot l (the root, the last
committed token, at local slot 0, i.e. position context_len). Afterwards the k-th accepted
node (k = 1..num_accepted, local index l_k) must sit at local slot k:

    local slot: 0    1    2    3    4    5          accepted path: 0 -> 2 -> 5
    before:    [r]  [a]  [b]  [c]  [d]  [e]
    after:     [r]  [b]  [e]  ...  (rest is garbage, overwritten next round)

`slot_map[b, l]` is the cache slot (row) of sequence b's local slot l: `root + l` for a
contiguous extent, the block table's row for a paged cache (`kv_cache.BlockManager`), so one
function serves both. Copies run in path order: l_k >= k and l_k increases along the path,
and the map is one-to-one, so the destination of step k is never the source of a later step
even where the ranges overlap.

The slot dimension of `cache` is explicit, so one function serves [layers, slots, heads,
head_dim] caches, MLA latent caches [layers, slots, latent] and any other layout.
"""

from __future__ import annotations

import torch

from outrider.kernels.backend import Backend, use_triton


def compact_kv(
    cache: torch.Tensor,  # [..., num_slots, ...] any dtype, slot dimension = slot_dim; mutated
    accepted_node_ids: torch.Tensor,  # [batch, max_accepted] int64; local nodes, -1 pad (VerifyOutput)
    slot_map: torch.Tensor,  # [batch, >= max node + 1] int64; cache slot of each local slot
    slot_dim: int,
    backend: Backend | None = None,
    moves: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """`moves`: `kv_moves` of the same arguments, when several caches move the same rows."""
    slot_dim = slot_dim % cache.dim()
    if accepted_node_ids.numel() == 0:
        return
    if use_triton(backend, cache.device):
        from outrider.kernels.kv_compaction_triton import compact_kv_triton

        compact_kv_triton(cache, accepted_node_ids, slot_map, slot_dim)
        return
    src, dst = moves if moves is not None else kv_moves(accepted_node_ids, slot_map)
    if dst.numel():
        # index_select copies first, so overlapping source and destination slots are safe.
        cache.index_copy_(slot_dim, dst, cache.index_select(slot_dim, src))


def kv_moves(accepted_node_ids: torch.Tensor, slot_map: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(source slots, destination slots) of the rows that must move; empty when every
    accepted path is already in place (a chain's always is). On CPU, that common case is
    told from the ids as Python ints: a dozen tensor ops cost ~0.1 ms at batch 1."""
    if accepted_node_ids.device.type == "cpu":
        rows = accepted_node_ids.tolist()
        if all(node < 0 or node == k for row in rows for k, node in enumerate(row, start=1)):
            empty = slot_map.new_empty(0)
            return empty, empty
    step = torch.arange(1, accepted_node_ids.shape[1] + 1, device=accepted_node_ids.device)
    moved = (accepted_node_ids >= 0) & (accepted_node_ids != step)
    src = slot_map.gather(1, accepted_node_ids.clamp(min=0))[moved]
    dst = slot_map[:, 1 : accepted_node_ids.shape[1] + 1][moved]
    return src, dst


def extent_slot_map(root_slots: torch.Tensor, width: int) -> torch.Tensor:
    """[batch, width] slot map of contiguous extents: local slot l of sequence b is root_b + l."""
    return root_slots[:, None] + torch.arange(width, device=root_slots.device)
