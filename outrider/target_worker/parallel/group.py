"""The tensor-parallel group a model is sharded over, and how each weight is split across it.

Megatron-style sharding, one all-reduce per block half:

    attention:  qkv   column-parallel (each rank owns whole heads)  -> local attention
                o     row-parallel    (each rank owns the matching input columns) -> all-reduce
    mlp:        gate/up column-parallel -> SiLU * up locally
                down  row-parallel -> all-reduce
    embedding / lm head: vocab-parallel (rows of the vocabulary) -> all-reduce / all-gather

KV heads: with H_kv >= world_size each rank owns H_kv / world_size of them; with fewer KV heads
than ranks (GQA/MQA on a wide group) each KV head is replicated on world_size / H_kv ranks,
and every rank's query heads still map onto its one local KV head (`kv_head_range`).

A `TPGroup` of world size 1 is the unsharded model: every collective is a no-op, so the
single-device path runs the same code without touching `torch.distributed`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    world_size: int = 1
    group: dist.ProcessGroup | None = None  # None = the default group (or no distributed at all)

    @staticmethod
    def from_default_group() -> TPGroup:
        """The whole default process group as one tensor-parallel group."""
        return TPGroup(rank=dist.get_rank(), world_size=dist.get_world_size())

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sums `x` over the group in place (returns it for chaining)."""
        if self.world_size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """[..., n] per rank -> [..., world_size * n], rank-major along the last dim."""
        if self.world_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    def even_range(self, size: int, what: str) -> tuple[int, int]:
        """This rank's [start, stop) of `size` items split evenly; refuses an uneven split."""
        if size % self.world_size:
            raise ValueError(f"{what} = {size} is not divisible by tensor-parallel size {self.world_size}")
        per_rank = size // self.world_size
        return self.rank * per_rank, (self.rank + 1) * per_rank

    def padded_range(self, size: int) -> tuple[int, int, int]:
        """(start, stop, per_rank) for a split padded up to a multiple of world size (vocab)."""
        per_rank = -(-size // self.world_size)
        start = min(self.rank * per_rank, size)
        return start, min(start + per_rank, size), per_rank

    def kv_head_range(self, num_heads: int, num_kv_heads: int) -> tuple[int, int]:
        """This rank's [start, stop) KV heads; replicated when there are fewer than ranks."""
        self.even_range(num_heads, "num_attention_heads")
        if num_kv_heads >= self.world_size:
            return self.even_range(num_kv_heads, "num_key_value_heads")
        if self.world_size % num_kv_heads:
            raise ValueError(
                f"num_key_value_heads = {num_kv_heads} neither divides nor is a multiple of "
                f"tensor-parallel size {self.world_size}"
            )
        head = self.rank * num_kv_heads // self.world_size
        return head, head + 1
