"""Tensor-parallel linears and the vocab-parallel embedding and head.

Weights arrive already sliced for this rank (the architecture file reads its shard with
`read_column` / `read_row`), so a linear here is one `mm`/`addmm` on a weight stored
transposed ([in, out], contiguous): no module hooks, no per-call shape logic, and on CPU the
pre-transposed layout is measurably faster than `F.linear` for the small-M matmuls of decode.
Row-parallel layers return *partial sums*; the caller all-reduces once per block half (the bias, if any, is added on rank 0 only so
the reduced sum carries it once).

Fused weights (`qkv`, `gate_up`) concatenate this rank's shard of each part along the output
dimension, so one matmul replaces three (or two) and the outputs split by known widths.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from outrider.target_worker.loader import CheckpointReader
from outrider.target_worker.parallel.group import TPGroup


class Linear:
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.weight_t = weight.t().contiguous()  # [in_local, out_local]
        self.bias = bias  # [out_local] or None

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """[T, in_local] -> [T, out_local], plus `residual` [T, out_local] if given.

        Folding the residual add into the matmul (`addmm`) saves an op and a temporary per
        block half; under TP only rank 0 passes the residual, so the all-reduced sum holds it once.
        """
        if residual is not None:
            out = torch.addmm(residual, x, self.weight_t)
            return out if self.bias is None else out.add_(self.bias)
        if self.bias is None:
            return torch.mm(x, self.weight_t)
        return torch.addmm(self.bias, x, self.weight_t)

    def scaled(self, x: torch.Tensor, row_scale: torch.Tensor) -> torch.Tensor:
        """(x @ W) * row_scale [T, 1] + bias: a linear whose input norm is folded in (`layers.norm`)."""
        out = torch.mm(x, self.weight_t).mul_(row_scale)
        return out if self.bias is None else out.add_(self.bias)


def read_column(
    reader: CheckpointReader,
    parts: Sequence[tuple[str, int, int]],
    dtype: torch.dtype,
    device: torch.device | str,
) -> torch.Tensor:
    """Fused column-parallel weight (or bias): rows [start, stop) of each named part, concatenated."""
    shards = [reader.read(name, dtype, dim=0, start=start, stop=stop) for name, start, stop in parts]
    return torch.cat(shards, dim=0).to(device)


def read_row(
    reader: CheckpointReader,
    name: str,
    start: int,
    stop: int,
    dtype: torch.dtype,
    device: torch.device | str,
) -> torch.Tensor:
    """Row-parallel weight: input columns [start, stop)."""
    return reader.read(name, dtype, dim=1, start=start, stop=stop).to(device)


class VocabParallelEmbedding:
    """Each rank holds vocabulary rows [start, stop); out-of-shard ids contribute zeros."""

    def __init__(self, weight: torch.Tensor, start: int, stop: int, tp: TPGroup):
        self.weight = weight  # [stop - start, H]
        self.start, self.stop, self.tp = start, stop, tp

    def __call__(self, token_ids: torch.Tensor) -> torch.Tensor:
        """[T] -> [T, H]."""
        if self.tp.world_size == 1:
            return F.embedding(token_ids, self.weight)
        outside = (token_ids < self.start) | (token_ids >= self.stop)
        local = (token_ids - self.start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside[:, None], 0.0)
        return self.tp.all_reduce(out)


class VocabParallelHead:
    """LM head split by vocabulary rows, padded to equal shards so all-gather needs no sizes."""

    def __init__(self, weight: torch.Tensor, per_rank: int, vocab_size: int, tp: TPGroup):
        pad = per_rank - weight.shape[0]
        # Padding rows produce logits that are sliced off after the gather.
        self.weight_t = F.pad(weight, (0, 0, 0, pad)).t().contiguous()  # [H, per_rank]
        self.vocab_size, self.tp = vocab_size, tp

    def __call__(self, hidden: torch.Tensor, row_scale: torch.Tensor) -> torch.Tensor:
        """[R, H] un-normalised rows and their `rms_scale` [R, 1] -> [R, V] logits on every rank."""
        logits = torch.mm(hidden, self.weight_t).mul_(row_scale)
        if self.tp.world_size == 1:
            return logits
        return self.tp.all_gather_last_dim(logits)[:, : self.vocab_size]
