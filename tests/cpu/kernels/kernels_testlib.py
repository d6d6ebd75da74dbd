"""Toy target/draft models and candidate-tree builders shared by the kernel tests.

The toy models are Markov chains over a small vocabulary: the distribution of the next token
depends only on the last one (row `last` of a [vocab, vocab] table), so the exact
distribution of the first two output tokens after a root r is p[r, a] * p[a, b].
"""

from __future__ import annotations

import torch

from outrider.kernels.packing import PackedTrees
from outrider.proto.tree import DraftSampling


def tree_parents(branching: list[int]) -> torch.Tensor:
    """Parents of a tree in level order where every level-l node has branching[l] children."""
    parents, level = [-1], [0]
    for k in branching:
        nxt = []
        for node in level:
            for _ in range(k):
                parents.append(node)
                nxt.append(len(parents) - 1)
        level = nxt
    return torch.tensor(parents, dtype=torch.int64)


def draft_trees(
    roots: torch.Tensor,  # [batch] int64 root tokens
    q_table: torch.Tensor,  # [vocab, vocab] draft probs of the next token given the last
    branching: list[int],
    mode: DraftSampling,
    gen: torch.Generator,
    q_scale: float = 1.0,  # sends q * scale on the wire: the verifier must renormalise
) -> PackedTrees:
    """Same-shaped trees for every root, children drawn from q as `mode` says."""
    batch = roots.numel()
    tokens = [roots[:, None]]  # per level: [batch, width]
    for k in branching:
        q = q_table[tokens[-1].reshape(-1)]  # [batch * width, vocab]
        if mode == DraftSampling.DETERMINISTIC:
            kids = q.topk(k, -1).indices
        else:
            kids = torch.multinomial(q, k, replacement=mode == DraftSampling.WITH_REPLACEMENT, generator=gen)
        tokens.append(kids.reshape(batch, tokens[-1].shape[1] * k))
    tokens = torch.cat(tokens, 1)  # [batch, nodes]
    parents = tree_parents(branching)
    nodes = parents.numel()
    has_kids = torch.zeros(nodes, dtype=torch.bool)
    has_kids[parents[1:]] = True
    expanded = has_kids.nonzero().squeeze(1)  # local nodes that have children
    q_nodes = (torch.arange(batch)[:, None] * nodes + expanded).reshape(-1)
    q_index = torch.full((batch * nodes,), -1, dtype=torch.int64)
    q_index[q_nodes] = torch.arange(q_nodes.numel())
    vocab = q_table.shape[0]
    flat_tokens = tokens.reshape(-1)
    return PackedTrees(
        token_ids=flat_tokens,
        parents=parents.repeat(batch),
        cu_num_draft_tokens=torch.arange(batch + 1, dtype=torch.int64) * nodes,
        sampling=torch.full((batch,), int(mode), dtype=torch.int64),
        q_index=q_index,
        q_token_ids=torch.arange(vocab).expand(q_nodes.numel(), vocab).clone(),
        q_probs=q_table[flat_tokens[q_nodes]] * q_scale,
        max_num_nodes=nodes,
    )


def chain(
    tokens: list[int], q: torch.Tensor | None = None, mode=DraftSampling.WITH_REPLACEMENT
) -> PackedTrees:
    """One chain tree: tokens[0] is the root; q [len(tokens) - 1, vocab] dense draft probs."""
    n = len(tokens)
    q = torch.zeros(max(n - 1, 0), 1) if q is None else q
    vocab = q.shape[1]
    return PackedTrees(
        token_ids=torch.tensor(tokens),
        parents=torch.arange(-1, n - 1),
        cu_num_draft_tokens=torch.tensor([0, n]),
        sampling=torch.tensor([int(mode)]),
        q_index=torch.cat([torch.arange(n - 1), torch.tensor([-1])]),
        q_token_ids=torch.arange(vocab).expand(n - 1, vocab).clone(),
        q_probs=q.float(),
        max_num_nodes=n,
    )


def concat(trees: list[PackedTrees]) -> PackedTrees:
    """One batch from several packed batches (in order)."""
    width = max(t.q_token_ids.shape[1] for t in trees)
    sizes = torch.cat([t.cu_num_draft_tokens[1:] - t.cu_num_draft_tokens[:-1] for t in trees])
    cu = torch.zeros(sizes.numel() + 1, dtype=torch.int64)
    cu[1:] = sizes.cumsum(0)
    q_offsets = torch.tensor([0] + [t.q_token_ids.shape[0] for t in trees]).cumsum(0)
    pad = torch.nn.functional.pad
    return PackedTrees(
        token_ids=torch.cat([t.token_ids for t in trees]),
        parents=torch.cat([t.parents for t in trees]),
        cu_num_draft_tokens=cu,
        sampling=torch.cat([t.sampling for t in trees]),
        q_index=torch.cat(
            [
                torch.where(t.q_index >= 0, t.q_index + o, -1)
                for t, o in zip(trees, q_offsets[:-1], strict=True)
            ]
        ),
        q_token_ids=torch.cat(
            [pad(t.q_token_ids, (0, width - t.q_token_ids.shape[1]), value=-1) for t in trees]
        ),
        q_probs=torch.cat([pad(t.q_probs, (0, width - t.q_probs.shape[1])) for t in trees]),
        max_num_nodes=max(t.max_num_nodes for t in trees),
    )


def random_trees(
    gen: torch.Generator,
    batch: int,
    max_nodes: int,
    vocab: int,
    q_top_k: int,
    greedy_bias: torch.Tensor | None = None,
) -> PackedTrees:
    """Random shapes, modes, tokens and sparse q (with -1 padding); a token is the argmax
    of `greedy_bias[parent token]` half the time, so greedy walks go deep."""
    sizes = torch.randint(1, max_nodes + 1, (batch,), generator=gen)
    parents, tokens = [], []
    for n in sizes.tolist():
        par = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]
        tok = torch.randint(0, vocab, (n,), generator=gen).tolist()
        for i in range(1, n):
            if greedy_bias is not None and torch.rand(1, generator=gen) < 0.5:
                tok[i] = int(greedy_bias[tok[par[i]]].argmax())
        parents += par
        tokens += tok
    total = int(sizes.sum())
    cu = torch.zeros(batch + 1, dtype=torch.int64)
    cu[1:] = sizes.cumsum(0)
    q_index = torch.where(torch.rand(total, generator=gen) < 0.9, torch.arange(total), -1)
    q_ids = torch.stack([torch.randperm(vocab, generator=gen)[:q_top_k] for _ in range(total)])
    q_ids[torch.rand(total, q_top_k, generator=gen) < 0.2] = -1
    token_ids = torch.tensor(tokens)
    # Make most children's tokens part of their parent's q support, as a drafter's are.
    parents_t = torch.tensor(parents)
    parent_flat = torch.repeat_interleave(cu[:-1], sizes) + parents_t.clamp(min=0)
    q_ids[parent_flat[parents_t >= 0], 0] = token_ids[parents_t >= 0]
    return PackedTrees(
        token_ids=token_ids,
        parents=parents_t,
        cu_num_draft_tokens=cu,
        sampling=torch.randint(0, 3, (batch,), generator=gen),
        q_index=q_index,
        q_token_ids=q_ids,
        q_probs=torch.rand(total, q_top_k, generator=gen),
        max_num_nodes=int(sizes.max()),
    )
