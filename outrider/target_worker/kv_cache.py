"""The preallocated KV cache: one row pool per layer and buffer, addressed by row.

Layout (every buffer the architecture asks for; Llama: "k" and "v", each [H_kv_local, D]):

    buffer[layer]:  [ rows: total_rows ][ *per_token_shape ]

Two ways to hand out rows, one per kind of user:

- **Paged** (the target engine): `block_manager.BlockManager` cuts the rows into blocks of
  block_size and gives each sequence a block table; it lives on the engine (TP rank 0) only,
  since every forward names its rows (`ForwardBatch.cache_rows`, `block_tables`).
- **Extents** (`allocate`; the drafters' own caches and tools): one contiguous extent per
  sequence with its most rows, first-fit with coalescing of freed neighbours. A drafter's
  sequence needs a bounded number of rows (a window of its context) and reads them as one
  range, so its bookkeeping stays this simple.

After verification `compact` moves each accepted path's rows into place through a slot map
(`kernels.compact_kv`), whichever way the rows were handed out.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch

from outrider.kernels.backend import use_triton
from outrider.kernels.kv_compaction import compact_kv, kv_moves
from outrider.target_worker.batch import ForwardBatch


class CacheFullError(RuntimeError):
    """Admission refused: the sequence does not fit in the KV cache."""


@dataclass(frozen=True)
class KVSpec:
    """What an architecture stores per token per layer, e.g. (("k", (2, 64)), ("v", (2, 64)))."""

    num_layers: int
    buffers: tuple[tuple[str, tuple[int, ...]], ...]
    dtype: torch.dtype

    def bytes_per_row(self) -> int:
        elements = sum(int(torch.tensor(shape).prod()) for _, shape in self.buffers)
        return elements * self.num_layers * torch.tensor([], dtype=self.dtype).element_size()


class KVCache:
    def __init__(self, spec: KVSpec, total_rows: int, device: torch.device | str = "cpu"):
        self.spec, self.total_rows = spec, total_rows
        self.buffers = {
            name: torch.zeros(spec.num_layers, total_rows, *shape, dtype=spec.dtype, device=device)
            for name, shape in spec.buffers
        }  # name -> [L, total_rows, *shape]
        names = [name for name, _ in spec.buffers]
        # Per-layer views, built once: the forward indexes a tuple, not a dict, per layer.
        self.layers = [tuple(self.buffers[n][layer] for n in names) for layer in range(spec.num_layers)]
        self._free: list[tuple[int, int]] = [(0, total_rows)]  # sorted (start, length)
        self._extents: dict[int, tuple[int, int]] = {}  # seq_id -> (start, length)
        self._length_at: dict[int, int] = {}  # start -> length, for per-forward bounds checks

    @staticmethod
    def rows_for_budget(spec: KVSpec, budget_bytes: int) -> int:
        """How many rows fit in `budget_bytes` of cache memory."""
        return budget_bytes // spec.bytes_per_row()

    def allocate(self, seq_id: int, num_rows: int) -> int:
        """Reserves `num_rows` contiguous rows for `seq_id`; returns the extent's first row."""
        if seq_id in self._extents:
            raise ValueError(f"sequence {seq_id} already holds a KV extent")
        if num_rows > self.total_rows:
            raise CacheFullError(
                f"sequence {seq_id} needs {num_rows} KV rows; the whole cache holds {self.total_rows}"
            )
        for i, (start, length) in enumerate(self._free):
            if length >= num_rows:
                if length == num_rows:
                    del self._free[i]
                else:
                    self._free[i] = (start + num_rows, length - num_rows)
                self._extents[seq_id] = (start, num_rows)
                self._length_at[start] = num_rows
                return start
        raise CacheFullError(
            f"sequence {seq_id} needs {num_rows} contiguous KV rows; {self.free_rows} of "
            f"{self.total_rows} are free (largest hole {self.largest_free_extent}) "
            f"across {len(self._extents)} admitted sequences"
        )

    def free(self, seq_id: int) -> None:
        start, length = self._extents.pop(seq_id)
        del self._length_at[start]
        i = bisect.bisect(self._free, (start, length))
        self._free.insert(i, (start, length))
        # Coalesce with the right, then the left neighbour.
        if i + 1 < len(self._free) and start + length == self._free[i + 1][0]:
            length += self._free.pop(i + 1)[1]
            self._free[i] = (start, length)
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == start:
            prev_start, prev_length = self._free.pop(i - 1)
            self._free[i - 1] = (prev_start, prev_length + length)

    def extent(self, seq_id: int) -> tuple[int, int]:
        """(start, length) of the sequence's rows."""
        return self._extents[seq_id]

    @property
    def free_rows(self) -> int:
        return sum(length for _, length in self._free)

    @property
    def largest_free_extent(self) -> int:
        return max((length for _, length in self._free), default=0)

    def check_rows(self, batch: ForwardBatch) -> None:
        """Refuses a batch that would read or write past a sequence's extent (extents: a
        sequence's first row is its extent's start) or past the cache (block tables)."""
        if batch.block_tables is not None:
            blocks = self.total_rows // batch.block_size
            if not 0 <= int(batch.block_tables.min()) <= int(batch.block_tables.max()) < blocks:
                raise ValueError(f"a forward names KV blocks outside the cache's {blocks}")
            return
        for start, kv_len in zip(batch.kv_index[:, 0].tolist(), batch.kv_lens, strict=True):
            length = self._length_at.get(start)
            if length is None:
                raise ValueError(f"no sequence holds a KV extent starting at row {start}")
            if kv_len > length:
                raise ValueError(
                    f"sequence at KV row {start} needs {kv_len} rows but was admitted with {length}"
                )

    def compact(
        self,
        accepted_node_ids: torch.Tensor,  # [B, max_accepted] int64; accepted local nodes after the root, -1 pad
        slot_map: torch.Tensor,  # [B, >= max node + 1] int64; cache row of each tree node's slot (root first)
    ) -> None:
        """After verification: move each accepted path's K/V rows to the slots after its root.

        The root and the path then occupy slots root .. root + accepted, exactly what a plain
        forward of those tokens would have written; rows past them are stale and are
        overwritten by the next forward (rollback by position, no clearing).
        """
        # The same rows move in every buffer (Triton's kernel finds them itself).
        moves = None if use_triton(None, accepted_node_ids.device) else kv_moves(accepted_node_ids, slot_map)
        for buffer in self.buffers.values():
            compact_kv(buffer, accepted_node_ids, slot_map, slot_dim=1, moves=moves)
