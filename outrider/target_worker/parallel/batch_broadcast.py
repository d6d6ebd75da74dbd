"""Rank 0 drives, the other tensor-parallel ranks follow: each step's work as tensor broadcasts.

Under TP every rank holds its own runner and KV cache shard and must see the same batch
and the same cache operations in the same order. Rank 0 runs the engine; its runner is
wrapped in `LeaderRunner`, which broadcasts every runner/cache call before doing it locally;
ranks 1.. sit in `follow()` and replay them. Only tensors cross (torch.distributed: gloo on
CPU, NCCL on GPU), never pickled objects (docs/architecture.md, "Invariants"):

    header [11] int64:  op | a | b | c | d | e | f | g | h | i | j    (sizes of what follows)
    FORWARD             ints = input_ids | positions | cache_rows | cu_seqlens | kv_lens |
                               logits_rows | capture layers | mask flags [B] | kv_index [B, h]
                               (extents) | block_tables [B, i] (paged; j = block_size)
                        masks = every given attention mask, flattened, as uint8
    ALLOCATE            a = seq_id, b = rows            FREE  a = seq_id
    COMMIT              ints = accepted_node_ids [a, b] | slot_map [a, c]

The target engine's paged block tables stay on rank 0: a forward names its rows and a commit
its slots, so the followers' caches are storage only.
    STOP                followers return
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from outrider.target_worker.batch import ForwardBatch, ForwardOutput, HiddenCapture
from outrider.target_worker.parallel.group import TPGroup

FORWARD, ALLOCATE, FREE, COMMIT, STOP = range(1, 6)
HEADER = 11


class BatchBroadcaster:
    def __init__(self, tp: TPGroup, device: torch.device | str = "cpu"):
        self.tp, self.device = tp, torch.device(device)
        self.src = dist.get_global_rank(tp.group, 0) if tp.group is not None else 0

    def _bcast(self, tensor: torch.Tensor) -> torch.Tensor:
        dist.broadcast(tensor, src=self.src, group=self.tp.group)
        return tensor

    def _header(self, *values: int) -> None:
        header = torch.zeros(HEADER, dtype=torch.int64, device=self.device)
        header[: len(values)] = torch.tensor(values, dtype=torch.int64)
        self._bcast(header)

    # ------------------------------------------------------------------ rank 0

    def send_forward(self, batch: ForwardBatch) -> None:
        flags = [m is not None for m in batch.attn_masks]
        masks = [m.reshape(-1).to(torch.uint8) for m in batch.attn_masks if m is not None]
        logits_rows = (
            batch.logits_rows if batch.logits_rows is not None else torch.empty(0, dtype=torch.int64)
        )
        layers = list(batch.capture.layer_inputs)
        none = torch.empty(0, 0, dtype=torch.int64)
        tables = batch.block_tables if batch.block_tables is not None else none
        kv_index = batch.kv_index if batch.kv_index is not None else none
        ints = torch.cat(
            [
                batch.input_ids.to(self.device, torch.int64),
                batch.positions.to(self.device, torch.int64),
                batch.cache_rows.to(self.device, torch.int64),
                torch.tensor([*batch.cu_seqlens, *batch.kv_lens], device=self.device),
                logits_rows.to(self.device, torch.int64),
                torch.tensor(layers + [int(f) for f in flags], dtype=torch.int64, device=self.device),
                kv_index.reshape(-1).to(self.device, torch.int64),
                tables.reshape(-1).to(self.device, torch.int64),
            ]
        )
        mask_numel = sum(m.numel() for m in masks)
        no_logits_rows = int(batch.logits_rows is None)
        self._header(
            FORWARD, batch.num_tokens, batch.batch_size, logits_rows.numel(), no_logits_rows, len(layers),
            int(batch.capture.final), mask_numel, kv_index.shape[1], tables.shape[1], batch.block_size,
        )  # fmt: skip
        self._bcast(ints)
        if mask_numel:
            self._bcast(torch.cat(masks).to(self.device))

    def send_allocate(self, seq_id: int, rows: int) -> None:
        self._header(ALLOCATE, seq_id, rows)

    def send_free(self, seq_id: int) -> None:
        self._header(FREE, seq_id)

    def send_commit(self, accepted_node_ids: torch.Tensor, slot_map: torch.Tensor) -> None:
        b, m = accepted_node_ids.shape
        self._header(COMMIT, b, m, slot_map.shape[1])
        ints = torch.cat([accepted_node_ids.reshape(-1), slot_map.reshape(-1)]).to(self.device, torch.int64)
        self._bcast(ints)

    def send_stop(self) -> None:
        self._header(STOP)

    # ------------------------------------------------------------------ ranks 1..

    def receive(self) -> tuple[int, Any]:
        """One operation from rank 0: (op, payload)."""
        header = self._bcast(torch.empty(HEADER, dtype=torch.int64, device=self.device)).tolist()
        op = header[0]
        if op == FORWARD:
            return op, self._receive_forward(*header[1:])
        if op == ALLOCATE:
            return op, (header[1], header[2])
        if op == FREE:
            return op, header[1]
        if op == COMMIT:
            b, m, w = header[1], header[2], header[3]
            ints = self._bcast(torch.empty(b * m + b * w, dtype=torch.int64, device=self.device))
            return op, (ints[: b * m].reshape(b, m), ints[b * m :].reshape(b, w))
        return op, None

    def _receive_forward(
        self, t, b, r, no_rows, n_layers, final, mask_numel, width, num_blocks, block_size
    ) -> ForwardBatch:
        size = 3 * t + (b + 1) + b + r + n_layers + b + b * width + b * num_blocks
        ints = self._bcast(torch.empty(size, dtype=torch.int64, device=self.device))
        parts = torch.split(ints, [t, t, t, b + 1, b, r, n_layers, b, b * width, b * num_blocks])
        input_ids, positions, cache_rows, cu, lens, rows, layers, flags, kv_index, tables = parts
        cu_l, lens_l = cu.tolist(), lens.tolist()
        flat = (
            self._bcast(torch.empty(mask_numel, dtype=torch.uint8, device=self.device))
            if mask_numel
            else None
        )
        masks, offset = [], 0
        for i, flag in enumerate(flags.tolist()):
            if not flag:
                masks.append(None)
                continue
            n = cu_l[i + 1] - cu_l[i]
            masks.append(flat[offset : offset + n * lens_l[i]].reshape(n, lens_l[i]).bool())
            offset += n * lens_l[i]
        return ForwardBatch(
            input_ids=input_ids,
            positions=positions,
            cache_rows=cache_rows,
            cu_seqlens=tuple(cu_l),
            kv_index=kv_index.reshape(b, width) if width else None,
            block_tables=tables.reshape(b, num_blocks) if block_size else None,
            block_size=block_size,
            kv_lens=tuple(lens_l),
            attn_masks=tuple(masks),
            logits_rows=None if no_rows else rows,
            capture=HiddenCapture(layer_inputs=tuple(layers.tolist()), final=bool(final)),
        )


def follow(runner: Any, broadcaster: BatchBroadcaster) -> int:
    """Ranks 1..: replay rank 0's operations on this rank's runner until STOP; returns forwards run."""
    forwards = 0
    while True:
        op, payload = broadcaster.receive()
        if op == FORWARD:
            try:
                runner.forward(payload)  # its collectives pair with rank 0's forward
            except ValueError:  # refused before any collective, exactly as on rank 0
                continue
            forwards += 1
        elif op == ALLOCATE:
            runner.cache.allocate(*payload)
        elif op == FREE:
            runner.cache.free(payload)
        elif op == COMMIT:
            runner.cache.compact(*payload)
        else:
            return forwards


class _LeaderCache:
    """Rank 0's KV cache: each mutation is broadcast, then done here; reads pass through."""

    def __init__(self, cache: Any, broadcaster: BatchBroadcaster):
        self._cache, self._bc = cache, broadcaster

    def allocate(self, seq_id: int, num_rows: int) -> int:
        start = self._cache.allocate(seq_id, num_rows)  # refusals (CacheFullError) stay on rank 0
        self._bc.send_allocate(seq_id, num_rows)
        return start

    def free(self, seq_id: int) -> None:
        self._cache.free(seq_id)
        self._bc.send_free(seq_id)

    def compact(self, accepted_node_ids: torch.Tensor, slot_map: torch.Tensor) -> None:
        self._bc.send_commit(accepted_node_ids, slot_map)
        self._cache.compact(accepted_node_ids, slot_map)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cache, name)


class LeaderRunner:
    """Rank 0's runner as the engine sees it: the same API, every call mirrored to the followers."""

    def __init__(self, runner: Any, broadcaster: BatchBroadcaster):
        self._runner, self._bc = runner, broadcaster
        self.cache = _LeaderCache(runner.cache, broadcaster)

    def forward(self, batch: ForwardBatch) -> ForwardOutput:
        self._bc.send_forward(batch)
        return self._runner.forward(batch)

    def stop_followers(self) -> None:
        self._bc.send_stop()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._runner, name)
