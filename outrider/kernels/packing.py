"""Candidate trees from the wire, flattened into one ragged batch for verification.

    tree 0 (3 nodes)    tree 1 (1 node)   tree 2 (4 nodes)
    [r0 a b]            [r1]              [r2 c d e]
    cu_num_draft_tokens = [0, 3, 4, 8]

Local node 0 of every tree is its root (the last committed token). `q_index` maps each
flattened node to the row of `q_token_ids` / `q_probs` holding the sparse distribution its
children were drawn from, or -1 where none was sent (deterministic drafts need none).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from outrider.proto.tree import CandidateTree


@dataclass
class PackedTrees:
    token_ids: torch.Tensor  # [total_nodes] int64; node 0 of each tree = its root
    parents: torch.Tensor  # [total_nodes] int64; local indices, -1 at roots, parents[i] < i
    cu_num_draft_tokens: torch.Tensor  # [batch + 1] int64; offsets of each tree's nodes
    sampling: torch.Tensor  # [batch] int64; proto DraftSampling value of each tree
    q_index: torch.Tensor  # [total_nodes] int64; row into q_token_ids / q_probs, or -1
    q_token_ids: torch.Tensor  # [num_expanded, q_top_k] int64; -1 = padding
    q_probs: torch.Tensor  # [num_expanded, q_top_k] float32; sparse, renormalised by verify
    max_num_nodes: int  # largest tree in the batch, root included

    @property
    def batch_size(self) -> int:
        return self.cu_num_draft_tokens.numel() - 1

    def to(self, device: torch.device | str) -> PackedTrees:
        moved = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in vars(self).items()}
        return PackedTrees(**moved)


def pack_trees(trees: list[CandidateTree], device: torch.device | str = "cpu") -> PackedTrees:
    """Flatten validated `proto` candidate trees (same order as `trees`) into one batch.

    Validated trees hold int64 tokens and float32 q already. Offsets and the q index are
    built as Python ints and made tensors once: at batch 1 each small tensor op costs more
    than the values it moves."""
    sizes = [t.tokens.shape[0] for t in trees]
    if max(sizes) == 1:  # root-only everywhere (plain decoding): no q, nothing to index
        return _pack_roots(trees, device)
    cu = [0, *itertools.accumulate(sizes)]
    q_top_k = max([t.q_token_ids.shape[1] for t in trees if t.q_token_ids.numel()] + [1])
    q_index = [-1] * cu[-1]
    q_ids, q_probs = [], []
    num_expanded = 0
    for tree, start in zip(trees, cu, strict=False):
        nodes = tree.q_nodes.tolist()
        if not nodes:
            continue
        for row, node in enumerate(nodes, start=num_expanded):
            q_index[start + node] = row
        num_expanded += len(nodes)
        pad = q_top_k - tree.q_token_ids.shape[1]
        q_ids.append(F.pad(tree.q_token_ids, (0, pad), value=-1) if pad else tree.q_token_ids)
        q_probs.append(F.pad(tree.q_probs, (0, pad), value=0.0) if pad else tree.q_probs)
    empty_ids = torch.empty(0, q_top_k, dtype=torch.int64)
    packed = PackedTrees(
        token_ids=torch.cat([t.tokens for t in trees]),
        parents=torch.cat([t.parents for t in trees]),
        cu_num_draft_tokens=torch.tensor(cu, dtype=torch.int64),
        sampling=torch.tensor([int(t.sampling) for t in trees], dtype=torch.int64),
        q_index=torch.tensor(q_index, dtype=torch.int64),
        q_token_ids=torch.cat(q_ids) if q_ids else empty_ids,
        q_probs=torch.cat(q_probs) if q_probs else empty_ids.to(torch.float32),
        max_num_nodes=max(sizes),
    )
    return packed.to(device) if torch.device(device).type != "cpu" else packed


def _pack_roots(trees: list[CandidateTree], device: torch.device | str) -> PackedTrees:
    batch = len(trees)
    return PackedTrees(
        token_ids=torch.cat([t.tokens for t in trees]).to(device=device, dtype=torch.int64),
        parents=torch.full((batch,), -1, dtype=torch.int64, device=device),
        cu_num_draft_tokens=torch.arange(batch + 1, dtype=torch.int64, device=device),
        sampling=torch.tensor([int(t.sampling) for t in trees], dtype=torch.int64, device=device),
        q_index=torch.full((batch,), -1, dtype=torch.int64, device=device),
        q_token_ids=torch.empty(0, 1, dtype=torch.int64, device=device),
        q_probs=torch.empty(0, 1, dtype=torch.float32, device=device),
        max_num_nodes=1,
    )
