"""Triton kernel for `compact_kv`: one program per (sequence, outer index).

The cache is viewed as [outer, num_slots, inner] (outer = dims before the slot dimension,
inner = dims after it); each program copies its sequence's accepted rows in path order.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from outrider.kernels.backend import next_power_of_2


@triton.jit
def _compact_kv_kernel(
    cache_ptr,  # [OUTER, NUM_SLOTS, INNER] any dtype, mutable
    accepted_ptr,  # [batch, MAX_ACCEPTED] int64; local nodes, -1 pad
    slot_map_ptr,  # [batch, MAP_WIDTH] int64; cache slot of each local slot
    NUM_SLOTS,
    INNER,
    MAP_WIDTH,
    MAX_ACCEPTED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    b = tl.program_id(0)
    outer = tl.program_id(1).to(tl.int64)
    slots = slot_map_ptr + b * MAP_WIDTH
    base = cache_ptr + outer * NUM_SLOTS * INNER
    for k in range(MAX_ACCEPTED):
        node = tl.load(accepted_ptr + b * MAX_ACCEPTED + k)
        if (node >= 0) & (node != k + 1):
            src = base + tl.load(slots + node) * INNER
            dst = base + tl.load(slots + k + 1) * INNER
            for off in range(0, INNER, BLOCK):
                offs = off + tl.arange(0, BLOCK)
                tl.store(dst + offs, tl.load(src + offs, mask=offs < INNER), mask=offs < INNER)
            # Later steps read slots this step may have written only through global memory.
            tl.debug_barrier()


def compact_kv_triton(
    cache: torch.Tensor, accepted_node_ids: torch.Tensor, slot_map: torch.Tensor, slot_dim: int
) -> None:
    """Same contract as `kv_compaction.compact_kv` (slot_dim already non-negative)."""
    if not cache.is_contiguous():
        raise ValueError("compact_kv's Triton kernel needs a contiguous cache")
    outer = math.prod(cache.shape[:slot_dim])
    inner = math.prod(cache.shape[slot_dim + 1 :])
    batch, max_accepted = accepted_node_ids.shape
    _compact_kv_kernel[(batch, outer)](
        cache,
        accepted_node_ids.contiguous(),
        slot_map.to(torch.int64).contiguous(),
        cache.shape[slot_dim],
        inner,
        slot_map.shape[1],
        MAX_ACCEPTED=max_accepted,
        BLOCK=min(next_power_of_2(inner), 1024),
    )
