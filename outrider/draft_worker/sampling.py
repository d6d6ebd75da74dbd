"""Draft-side sampling: the q a drafter draws from, and the two ways it draws children.

Shared by the dynamic tree builder (`tree_builder`) and Medusa's static trees (`medusa`).
Every function works on sparse q rows, the same rows a candidate tree sends:

    ids       [..., W] int64    the row's tokens, most probable first; -1 = padding
    rows      [..., W] float32  their q, renormalised over the row (0 where padded)
    uniforms  [..., n] float32  in (0, 1), one per draw; n <= W

    WITHOUT_REPLACEMENT  draw i is from q restricted to the tokens not drawn yet (Gumbel-top-k)
    WITH_REPLACEMENT     n i.i.d. draws from q (inverse CDF)

A draw is the child's token whether or not the tree keeps that child, and the row sent is the
row drawn from: that is what keeps verification lossless.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from outrider.proto import DraftSampling, SamplingParams


class QParams(NamedTuple):
    """Per-row `process_logits` arguments for draft q rows: `process_logits(logits, *qp)`.

    A greedy sequence's q is the plain softmax (temperature 1, no truncation), so its children
    are scored as EAGLE-2 scores them rather than by a one-hot; a sampled sequence's q gets its
    own temperature/top-k/top-p/min-p, as the target's p does.
    """

    temperature: torch.Tensor  # [rows] float32
    top_k: torch.Tensor  # [rows] int64; 0 = off
    top_p: torch.Tensor  # [rows] float32
    min_p: torch.Tensor  # [rows] float32

    @classmethod
    def of(cls, params: Sequence[SamplingParams], device: torch.device, repeats: int = 1) -> QParams:
        """One row per sequence, or `repeats` consecutive rows each (one per head)."""

        def per_row(values: list) -> torch.Tensor:
            return torch.tensor(values, device=device).repeat_interleave(repeats)

        return cls(
            per_row([1.0 if s.greedy else s.temperature for s in params]),
            per_row([0 if s.greedy else s.top_k for s in params]),
            per_row([1.0 if s.greedy else s.top_p for s in params]),
            per_row([0.0 if s.greedy else s.min_p for s in params]),
        )

    def take(self, rows: torch.Tensor) -> QParams:
        return QParams(*(values[rows] for values in self))


def draw_without_replacement(ids: torch.Tensor, rows: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Gumbel-top-k: sorting log q + Gumbel noise gives sequential draws without replacement;
    [..., W] ids in draw order (uniforms [..., W])."""
    keys = rows.log() - (-uniforms.log()).log()
    return ids.gather(-1, keys.argsort(-1, descending=True))


def draw_with_replacement(ids: torch.Tensor, rows: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draws, one per uniform: [..., n] i.i.d. ids from each row."""
    cdf = rows.cumsum(-1)  # [..., W]
    picks = (cdf[..., None, :] <= uniforms[..., :, None] * cdf[..., -1:, None]).sum(-1)  # [..., n]
    support = (rows > 0).sum(-1, keepdim=True)
    return ids.gather(-1, torch.minimum(picks, support - 1).clamp(min=0))


def draw(mode: DraftSampling, ids: torch.Tensor, rows: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """[..., W] ids in draw order under one sampled mode (uniforms [..., W])."""
    if mode == DraftSampling.WITHOUT_REPLACEMENT:
        return draw_without_replacement(ids, rows, uniforms)
    return draw_with_replacement(ids, rows, uniforms)


def batch_uniforms(generators: Sequence[torch.Generator | None], rows: int, width: int) -> torch.Tensor:
    """[G, rows, width] uniforms in (0, 1): seeded sequences from their own generator (the same
    draws whatever they are batched with), the rest from torch's global RNG in one call."""
    out = torch.empty(len(generators), rows, width)
    unseeded = [g for g, gen in enumerate(generators) if gen is None]
    if unseeded:
        out[unseeded] = torch.rand(len(unseeded), rows, width)
    for g, gen in enumerate(generators):
        if gen is not None:
            out[g] = torch.rand(rows, width, generator=gen)
    return clamp_uniforms(out)


def clamp_uniforms(uniforms: torch.Tensor) -> torch.Tensor:
    """Uniforms clamped away from 0 in place: Gumbel keys need log(u) finite."""
    return uniforms.clamp_(min=torch.finfo(torch.float32).tiny)
