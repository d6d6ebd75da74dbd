"""Rank 0 drives, the other tensor-parallel ranks follow: each step's work as tensor broadcasts.

Under TP every rank holds its own runner and KV cache shard and must see the same batch
and the same cache operations in the same order. Rank 0 runs the engine; its runner is
wrapped in `LeaderRunner`, which broadcasts every runner/cache call before doing it locally;
ranks 1.. sit in `follow()` and replay them. Only tensors cross (torch.distributed: gloo on
CPU, NCCL on GPU), never pickled objects (docs/architecture.md, "Invariants"):

    header [8] int64:   op | a | b | c | d | e | f | g     (sizes of what follows)
    FORWARD             ints = input_ids | positions | cache_rows | cu_seqlens | kv_starts |
                               kv_lens | logits_rows | capture layers | mask flags [B]
                        masks = every given attention mask, flattened, as uint8
    ALLOCATE            a = seq_id, b = rows            FREE  a = seq_id
    COMMIT              ints = accepted_node_ids [a, b] | root_rows [a]
    STOP                followers return
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from outrider.target_worker.batch import ForwardBatch, ForwardOutput, HiddenCapture
from outrider.target_worker.parallel.group import TPGroup

FORWARD, ALLOCATE, FREE, COMMIT, STOP = range(1, 6)
HEADER = 8


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
        ints = torch.cat(
            [
                batch.input_ids.to(self.device, torch.int64),
                batch.positions.to(self.device, torch.int64),
                batch.cache_rows.to(self.device, torch.int64),
                torch.tensor([*batch.cu_seqlens, *batch.kv_starts, *batch.kv_lens], device=self.device),
                logits_rows.to(self.device, torch.int64),
                torch.tensor(layers + [int(f) for f in flags], dtype=torch.int64, device=self.device),
            ]
        )
        mask_numel = sum(m.numel() for m in masks)
        no_logits_rows = int(batch.logits_rows is None)
        self._header(
            FORWARD, batch.num_tokens, batch.batch_size, logits_rows.numel(), no_logits_rows, len(layers),
            int(batch.capture.final), mask_numel,
        )  # fmt: skip
        self._bcast(ints)
        if mask_numel:
            self._bcast(torch.cat(masks).to(self.device))

    def send_allocate(self, seq_id: int, rows: int) -> None:
        self._header(ALLOCATE, seq_id, rows)

    def send_free(self, seq_id: int) -> None:
        self._header(FREE, seq_id)

    def send_commit(self, accepted_node_ids: torch.Tensor, root_rows: torch.Tensor) -> None:
        b, m = accepted_node_ids.shape
        self._header(COMMIT, b, m)
        ints = torch.cat([accepted_node_ids.reshape(-1), root_rows.reshape(-1)]).to(self.device, torch.int64)
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
            b, m = header[1], header[2]
            ints = self._bcast(torch.empty(b * m + b, dtype=torch.int64, device=self.device))
            return op, (ints[: b * m].reshape(b, m), ints[b * m :])
        return op, None

    def _receive_forward(self, t, b, r, no_rows, n_layers, final, mask_numel) -> ForwardBatch:
        size = 3 * t + (b + 1) + 2 * b + r + n_layers + b
        ints = self._bcast(torch.empty(size, dtype=torch.int64, device=self.device))
        parts = torch.split(ints, [t, t, t, b + 1, b, b, r, n_layers, b])
        input_ids, positions, cache_rows, cu, starts, lens, rows, layers, flags = parts
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
            kv_starts=tuple(starts.tolist()),
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
            runner.cache.commit_paths(*payload)
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

    def commit_paths(self, accepted_node_ids: torch.Tensor, root_rows: torch.Tensor) -> None:
        self._bc.send_commit(accepted_node_ids, root_rows)
        self._cache.commit_paths(accepted_node_ids, root_rows)

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
