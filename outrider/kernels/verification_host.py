"""Tree verification on the CPU for small batches: each tree walked in Python.

The same walk as `verification.verify_reference` (module docstring there: greedy rows accept
the child carrying the target's argmax; sampled rows test u against the residual r and the
working q per the tree's `DraftSampling`), with the same float32 arithmetic, so the same
`VerifyRandoms` give the same tokens. The reference walks every tree together with tens of
tensor ops per tree level: a sampled chain of four at batch 1 (vocabulary 8192) took ~0.87
ms on the 2-core CPU, ~1.4 ms inside a round; here a node costs a few scalar reads, and only
the vocabulary-wide work (a residual's update after a rejection, the final draw) is a torch
op on one row: ~0.17 ms (batch 8: 1.0 ms against 2.1). Past a handful of sequences the per-tree loop costs more than the batched
walk (`verify` picks: `HOST_MAX_BATCH`), except for all-greedy batches, which touch no
vocabulary row at all.
"""

from __future__ import annotations

import numpy as np
import torch

from outrider.kernels.packing import PackedTrees
from outrider.proto.tree import DraftSampling

_DETERMINISTIC = int(DraftSampling.DETERMINISTIC)
_WITHOUT_REPLACEMENT = int(DraftSampling.WITHOUT_REPLACEMENT)

# Batches with a sampled tree up to this size are walked here on the CPU (all-greedy ones at
# any size).
HOST_MAX_BATCH = 8

_f32 = np.float32


def walk_host(
    trees: PackedTrees,
    target_probs: torch.Tensor,  # [total_nodes, vocab] float32
    is_greedy: list[bool],
    uniforms: list[float] | None,  # [total_nodes] (None: every row greedy)
    exponentials: torch.Tensor | None,  # [batch, vocab] (None: every row greedy, or root-only)
) -> tuple[list[list[int]], list[int]]:
    """Each tree's accepted local nodes (in order) and its final token (recovered or bonus;
    for a sampled root-only tree the exponential race's, which `verify` then replaces)."""
    cu = trees.cu_num_draft_tokens.tolist()
    parents, tokens = trees.parents.tolist(), trees.token_ids.tolist()
    modes = trees.sampling.tolist()
    greedy_nodes = [i for b, g in enumerate(is_greedy) if g for i in range(cu[b], cu[b + 1])]
    argmax = {}
    if greedy_nodes:
        every = len(greedy_nodes) == target_probs.shape[0]
        argmax = dict(
            zip(greedy_nodes, _argmax_rows(target_probs, None if every else greedy_nodes), strict=True)
        )
    paths, finals = [], []
    for b in range(len(cu) - 1):
        start, size = cu[b], cu[b + 1] - cu[b]
        children: list[list[int]] = [[] for _ in range(size)]
        for i in range(1, size):
            children[parents[start + i]].append(i)
        if is_greedy[b]:
            path, final = _greedy_walk(children, tokens, argmax, start)
        else:
            path, final = _sampled_walk(
                trees, target_probs, children, tokens, uniforms, exponentials[b], start, modes[b]
            )
        paths.append(path)
        finals.append(final)
    return paths, finals


def _argmax_rows(values: torch.Tensor, rows: list[int] | None) -> list[int]:
    """Each of `rows` of `values` (None: every row): its first largest entry's index, as
    torch.argmax. By numpy where it holds the dtype: for a few rows of a vocabulary it runs
    ~10x torch's (5 x 8192 float32 logits, one thread: ~4 us against ~37, ~66 with the rows
    gathered first), and at batch 1 this is every greedy round's."""
    if values.dtype in (torch.float32, torch.float64, torch.float16):
        array = values.numpy()
        return (array if rows is None else array[rows]).argmax(-1).tolist()
    return (values if rows is None else values[rows]).argmax(-1).tolist()


def _greedy_walk(children, tokens, argmax, start) -> tuple[list[int], int]:
    """From the root, the first child (in node order) carrying the target's argmax at its
    parent, then its children."""
    node, path = 0, []
    while True:
        want = argmax[start + node]
        for child in children[node]:
            if tokens[start + child] == want:
                path.append(child)
                node = child
                break
        else:
            return path, want


def _sampled_walk(
    trees, target_probs, children, tokens, uniforms, exps, start, mode
) -> tuple[list[int], int]:
    """One sampled tree: children tried in node order against the residual r of the current
    node (p until a rejection changes it) and its working q, as `verify_reference` does."""
    node, path = 0, []
    residual = target_probs[start]  # a view of p until a rejection writes to it
    owned = False
    mass = _row_sum(residual)
    q_ids, q_w = _load_q(trees, start)
    tried = 0  # children of `node` tried so far
    while tried < len(children[node]):
        child = children[node][tried]
        tried += 1
        x = tokens[start + child]
        p_x = _f32(residual[x].item()) / mass if mass > 0 else _f32(0.0)
        q_mass = _f32(q_w.sum().item())
        q_x = _f32((q_w * (q_ids == x)).sum().item()) / q_mass if q_mass > 0 else _f32(0.0)
        u = _f32(uniforms[start + child])
        if mode == _DETERMINISTIC:
            accept = u < p_x
        else:
            accept = q_x > 0 and u * q_x < p_x
        if accept:
            path.append(child)
            node, tried = child, 0
            residual, owned = target_probs[start + child], False
            mass = _row_sum(residual)
            q_ids, q_w = _load_q(trees, start + child)
        elif mode == _DETERMINISTIC:
            if not owned:
                residual, owned = residual.clone(), True
            mass = mass - _f32(residual[x].item())
            residual[x] = 0.0
        else:
            q_dense = torch.zeros_like(residual).scatter_add_(
                0, q_ids.clamp(min=0), q_w / torch.tensor(q_mass)
            )
            safe = torch.tensor([mass if mass > 0 else 1.0], dtype=residual.dtype)
            residual, owned = torch.relu(residual / safe - q_dense), True
            mass = _row_sum(residual)
            if mode == _WITHOUT_REPLACEMENT:
                q_w = torch.where(q_ids == x, 0.0, q_w)
    source = residual if mass > 0 else target_probs[start + node]
    return path, int((source / exps).argmax())


def _load_q(trees: PackedTrees, node: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Node `node`'s sparse q as the reference loads it: ids [K] (-1 pad) and float32 weights
    [K] (0 at pads; all 0 for a node without q, which rejects every sampled child)."""
    width = trees.q_token_ids.shape[1]
    row = int(trees.q_index[node])
    if row < 0 or trees.q_token_ids.shape[0] == 0:
        return torch.full((width,), -1, dtype=torch.int64), torch.zeros(width)
    ids = trees.q_token_ids[row]
    return ids, torch.where(ids >= 0, trees.q_probs[row], 0.0)


def _row_sum(row: torch.Tensor) -> np.float32:
    """A row's sum as the reference takes it (a [1, vocab] reduction)."""
    return _f32(row[None].sum(-1).item())
