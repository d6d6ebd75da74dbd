"""EAGLE-2 dynamic candidate trees (arXiv 2406.16858), shared by every model-based proposer.

A proposer hands over its root logits and one batched callback; the builder does the rest:

    trees = build_trees(updates, budgets, root_logits, logits_fn, sampled_mode=..., generators=...)
    logits_fn(frontier: Frontier) -> logits [frontier.num_rows, vocab]

For every sequence of the batch at once, depth by depth (budget = max_nodes N, max_depth D,
top_k k, per sequence and per round):

    expand   each frontier node's q = process_logits(logits) gets k children (the logits first
             through the target's path processors when the request has any); a child's score
             V is its parent's V times its sibling weight (below)
    select   the next frontier = the k best new nodes of each sequence (by V), whose logits
             come from one logits_fn call for the whole batch; a node already outranked by
             N - 1 others is not expanded (no descendant of it could make the cut)
    rerank   after depth D: the N - 1 best nodes of all depths, which are prefix-closed
             because V never grows along a path; sorted by depth so parents precede children

    depth 0      root                      frontier: root
    depth 1      a(.5)  b(.3)  c(.1)       k = 3 children of the root; frontier: a b c
    depth 2      aa(.4) ab(.05) ba(.2)...  9 candidates; frontier: the best 3 of them
    rerank, N = 5: root a b aa ba

Children and q. At temperature 0 children are the top-k tokens of softmax(logits) and the tree
is DETERMINISTIC. At T > 0 the q row is the top-W of process_logits(logits) with the sequence's
own temperature/top-k/top-p/min-p, renormalised (W = the budget's q_width, >= k), and the k
children are drawn from exactly that row (with or without replacement, as `sampled_mode` says,
or its top-k when DETERMINISTIC); the row sent is the row drawn from, which is what makes
verification lossless. A wide row matters most for chains: a child drawn from a one-entry row
(a point mass) is accepted with probability p(x), from a W-entry row with ~ sum(min(p, q_W)).

Why sibling weights, not the drawn token's probability. A sampled child must be a fresh draw
from q *whether or not it is kept*: if the rerank kept a drawn child because its own token
scored well, kept children would lean to likely tokens and verification would be biased. So
the i-th child of node u scores V(u) * w_i with w_i = the i-th largest probability of q_u,
fixed before the draw (for top-k children w_i is exactly their probability, so T = 0 is plain
EAGLE-2). Ties are broken by depth, then by draw order (parents' order, then sibling index),
so a child's fate depends only on nodes that rank above it, never on its own or a later
sibling's token; siblings enter the tree in draw order, as the verifier tries them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from outrider.draft_worker.path_processors import DraftProcessors
from outrider.draft_worker.proposer import root_only_tree
from outrider.draft_worker.sampling import (
    QParams,
    clamp_uniforms,
    draw_with_replacement,
    draw_without_replacement,
)
from outrider.kernels import process_logits
from outrider.proto import CandidateTree, DraftSampling, SequenceUpdate, TreeBudget


@dataclass
class Frontier:
    """The nodes of one depth, across the batch, whose next-token logits the builder needs.

    Rows of one call are the children of rows of the previous call (`parent_row`), so a
    proposer with a KV cache keeps each row's KV and attends along that chain; a stateless
    one reads `paths`.
    """

    depth: int  # of every row; the root is depth 0, so the first call has depth 1
    seq_index: torch.Tensor  # [num_rows] int64; position of the row's sequence in `updates`
    tokens: torch.Tensor  # [num_rows] int64; the row's draft token
    parent_row: torch.Tensor  # [num_rows] int64; row of the previous call, -1 = the root
    paths: torch.Tensor  # [num_rows, depth + 1] int64; root token, then drafts down to the row

    @property
    def num_rows(self) -> int:
        return self.tokens.shape[0]


LogitsFn = Callable[[Frontier], torch.Tensor]  # -> [frontier.num_rows, vocab] draft logits


def draft_generator(seed: int | None) -> torch.Generator | None:
    """A seeded sequence's draft RNG; None (unseeded) means torch's global RNG.

    Derived from the seed, never equal to it: the target seeds its verify draws from the same
    number, and draft and verify randomness must be independent.
    """
    if seed is None:
        return None
    digest = hashlib.sha256(f"outrider-draft:{seed}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)


@dataclass
class _Nodes:
    """Nodes of one depth across the batch: a level of candidates, or the frontier."""

    seq: torch.Tensor  # [n] int64; sequence (position in `updates`)
    parent: torch.Tensor  # [n] int64; candidate id of the parent, -1 = the root
    token: torch.Tensor  # [n] int64
    score: torch.Tensor  # [n] float32; log V
    order: torch.Tensor  # [n] int64; draw-order rank within the depth (the tie-break)

    def take(self, rows: torch.Tensor) -> _Nodes:
        return _Nodes(self.seq[rows], self.parent[rows], self.token[rows], self.score[rows], self.order[rows])


@dataclass
class _QRows:
    """The sparse q row of every expanded node (the root or a candidate)."""

    owner: torch.Tensor  # [rows] int64; candidate id, -1 = the root of `seq`
    seq: torch.Tensor  # [rows] int64
    ids: torch.Tensor  # [rows, width] int64; -1 = padding
    probs: torch.Tensor  # [rows, width] float32; 0 where padded


def build_trees(
    updates: Sequence[SequenceUpdate],
    budgets: Sequence[TreeBudget],
    root_logits: torch.Tensor,  # [batch, vocab] draft logits after each root
    logits_fn: LogitsFn,
    *,
    sampled_mode: DraftSampling,
    generators: Sequence[torch.Generator | None],
    processors: DraftProcessors | None = None,
) -> list[CandidateTree]:
    """One candidate tree per update (CPU tensors), each within its budget. `processors`: the
    target's penalties, logit_bias and min_tokens, applied to each row's logits with its path
    before its q is formed (`path_processors`)."""
    device = root_logits.device
    batch = len(updates)
    top_k = torch.tensor([b.top_k for b in budgets], device=device)  # [batch]
    max_depth = torch.tensor([b.max_depth for b in budgets], device=device)  # [batch]
    max_drafts = torch.tensor([b.max_nodes - 1 for b in budgets], device=device)  # [batch]
    active = (top_k > 0) & (max_depth > 0) & (max_drafts > 0)
    if not bool(active.any()):
        return [root_only_tree(u) for u in updates]
    width, depth_limit = int(top_k[active].max()), int(max_depth[active].max())
    modes = [DraftSampling.DETERMINISTIC if u.sampling.greedy else sampled_mode for u in updates]
    # Entries of each sequence's q rows: the budget's q_width when its children are drawn.
    q_widths = [_q_width(b, m) for b, m in zip(budgets, modes, strict=True)]
    q_width = max(w for w, a in zip(q_widths, active.tolist(), strict=True) if a)
    expander = _Expander(updates, modes, top_k, width, torch.tensor(q_widths, device=device), q_width, device)
    noise = _draw_uniforms(budgets, modes, generators, width, q_width, depth_limit).to(device)

    roots = torch.stack([u.new_tokens[-1] for u in updates]).to(device)  # [batch]
    seq = active.nonzero().squeeze(1)
    none = torch.full_like(seq, -1)
    frontier = _Nodes(seq, none, roots[seq], torch.zeros(seq.shape, device=device), seq * 0)
    frontier_ids, slot, paths, logits = none, seq * 0, roots[seq][:, None], root_logits[seq]
    levels: list[_Nodes] = []
    q_rows: list[_QRows] = []
    num_candidates = 0
    for depth in range(depth_limit):
        if processors is not None:
            logits = processors(logits, frontier.seq, paths[:, 1:])
        children, row, ids, probs = expander.expand(
            frontier, frontier_ids, logits, noise[frontier.seq, depth, slot]
        )
        q_rows.append(_QRows(frontier_ids, frontier.seq, ids, probs))
        levels.append(children)
        child_ids = num_candidates + torch.arange(children.seq.shape[0], device=device)
        num_candidates += children.seq.shape[0]
        rank = _rank_within_sequence(children.seq, batch, children.score, children.order)
        chosen = (rank < top_k[children.seq]) & (depth + 1 < max_depth[children.seq])
        chosen &= children.score > _cutoff(levels, batch, max_drafts)[children.seq]
        if not bool(chosen.any()):
            break
        picked = chosen.nonzero().squeeze(1)
        frontier, frontier_ids, slot = children.take(picked), child_ids[picked], rank[picked]
        parent_row = row[picked] if depth > 0 else torch.full_like(picked, -1)
        paths = torch.cat([paths[row[picked]], frontier.token[:, None]], 1)
        logits = logits_fn(Frontier(depth + 1, frontier.seq, frontier.token, parent_row, paths))
        if logits.shape[0] != picked.shape[0]:
            raise ValueError(f"logits_fn returned {logits.shape[0]} rows for a frontier of {picked.shape[0]}")
    return _assemble(updates, budgets, modes, levels, q_rows, max_drafts)


def _q_width(budget: TreeBudget, mode: DraftSampling) -> int:
    """Entries per q row: top-k rows for DETERMINISTIC trees, q_width ones when children are drawn."""
    return budget.top_k if mode == DraftSampling.DETERMINISTIC else budget.q_width


class _Expander:
    """Children of frontier nodes: each node's q row, its children's tokens and scores."""

    def __init__(
        self,
        updates: Sequence[SequenceUpdate],
        modes: Sequence[DraftSampling],
        top_k: torch.Tensor,  # [batch] int64; children per node of each sequence
        width: int,  # max of top_k
        q_widths: torch.Tensor,  # [batch] int64; entries of each sequence's q rows (>= its top_k)
        q_width: int,  # max of q_widths: the padded row width
        device: torch.device,
    ) -> None:
        # Greedy sequences score children by the plain softmax (EAGLE-2), not a one-hot.
        self.q_params = QParams.of([u.sampling for u in updates], device)  # [batch] each
        self.mode = torch.tensor([int(m) for m in modes], device=device)  # [batch]
        self.children_per_node, self.width = top_k, width
        self.q_widths, self.q_width = q_widths, q_width

    def expand(
        self,
        frontier: _Nodes,
        frontier_ids: torch.Tensor,  # [F] int64; candidate id of each row, -1 = root
        logits: torch.Tensor,  # [F, vocab]
        uniforms: torch.Tensor,  # [F, width] in (0, 1); this round's draws for each row
    ) -> tuple[_Nodes, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(children, frontier row of each child, q ids [F, q_width], q probs [F, q_width])."""
        seq, width = frontier.seq, self.width
        q = process_logits(logits, *self.q_params.take(seq))
        top, ids = q.topk(self.q_width, dim=-1)  # [F, q_width]; sorted
        entry = torch.arange(self.q_width, device=q.device)
        top = torch.where(entry < self.q_widths[seq][:, None], top, 0.0)  # this sequence's q_width
        ids = torch.where(top > 0, ids, -1)
        sibling = torch.arange(width, device=q.device)
        # w_i, the i-th largest probability, scores child i; child i exists iff q has an
        # (i+1)-th token: both fixed before any draw.
        weights = torch.where(sibling < self.children_per_node[seq][:, None], top[:, :width], 0.0)
        exists = weights > 0
        mode = self.mode[seq][:, None]
        sampled = mode != int(DraftSampling.DETERMINISTIC)
        row = torch.where(sampled, top / top.sum(-1, keepdim=True), top)  # the q drawn from
        tokens = torch.where(
            mode == int(DraftSampling.WITHOUT_REPLACEMENT),
            draw_without_replacement(ids, row, uniforms)[:, :width],
            torch.where(
                mode == int(DraftSampling.WITH_REPLACEMENT),
                draw_with_replacement(ids, row, uniforms[:, :width]),
                ids[:, :width],
            ),
        )
        score = frontier.score[:, None] + weights.log()  # [F, width]
        order = frontier.order[:, None] * width + sibling  # parents' draw order, then sibling index
        row_of_child, index = exists.nonzero(as_tuple=True)
        children = _Nodes(
            seq=seq[row_of_child],
            parent=frontier_ids[row_of_child],
            token=tokens[row_of_child, index],
            score=score[row_of_child, index],
            order=order[row_of_child, index].argsort().argsort(),  # dense rank within the depth
        )
        return children, row_of_child, ids, row


def _draw_uniforms(
    budgets: Sequence[TreeBudget],
    modes: Sequence[DraftSampling],
    generators: Sequence[torch.Generator | None],
    width: int,
    q_width: int,
    depth_limit: int,
) -> torch.Tensor:  # [batch, depth_limit, width (frontier slot), q_width (q entry)] float32, CPU
    """Uniforms for the round's draws (one per q entry: Gumbel keys without replacement, the
    first k as inverse-CDF draws with), per sequence from its own generator, so a seeded
    sequence drafts the same whatever it is batched with."""
    noise = torch.zeros(len(budgets), depth_limit, width, q_width)
    for b, (budget, mode, generator) in enumerate(zip(budgets, modes, generators, strict=True)):
        if mode != DraftSampling.DETERMINISTIC and budget.top_k > 0 and budget.max_nodes > 1:
            k, d, w = budget.top_k, budget.max_depth, budget.q_width
            noise[b, :d, :k, :w] = torch.rand(d, k, w, generator=generator)
    return clamp_uniforms(noise)


def _cutoff(levels: list[_Nodes], batch: int, max_drafts: torch.Tensor) -> torch.Tensor:
    """[batch] score of each sequence's (N - 1)-th best candidate so far, -inf if it has fewer.

    A frontier node scoring no higher is not expanded: its descendants score no higher than
    it and are deeper, so none could enter the final tree (an exact cut, not a heuristic).
    """
    seq = torch.cat([level.seq for level in levels])
    score = torch.cat([level.score for level in levels])
    depth = torch.cat([torch.full_like(level.seq, d) for d, level in enumerate(levels)])
    rank = _rank_within_sequence(seq, batch, score, depth, torch.cat([level.order for level in levels]))
    last = rank == max_drafts[seq] - 1
    cutoff = torch.full((batch,), float("-inf"), device=score.device)
    cutoff[seq[last]] = score[last]
    return cutoff


def _lexsort(*keys: torch.Tensor) -> torch.Tensor:
    """Permutation sorting by `keys` ascending, the first key most significant."""
    perm = torch.arange(keys[0].shape[0], device=keys[0].device)
    for key in reversed(keys):
        perm = perm[key[perm].argsort(stable=True)]
    return perm


def _rank_within_sequence(
    seq: torch.Tensor,  # [n] int64
    batch: int,
    score: torch.Tensor,  # [n] float32, finite; higher first
    *tie_breaks: torch.Tensor,  # [n] each; lower first
) -> torch.Tensor:  # [n] int64; 0 = the sequence's best node
    perm = _lexsort(seq, -score, *tie_breaks)
    counts = torch.bincount(seq, minlength=batch)
    rank = torch.empty_like(seq)
    rank[perm] = torch.arange(seq.shape[0], device=seq.device) - (counts.cumsum(0) - counts)[seq[perm]]
    return rank


def _assemble(
    updates: Sequence[SequenceUpdate],
    budgets: Sequence[TreeBudget],
    modes: Sequence[DraftSampling],
    levels: list[_Nodes],
    q_rows: list[_QRows],
    max_drafts: torch.Tensor,  # [batch] int64
) -> list[CandidateTree]:
    """Rerank every sequence's candidates to its best N - 1 and lay them out as trees."""
    batch = len(updates)
    seq = torch.cat([level.seq for level in levels])  # [C]
    parent = torch.cat([level.parent for level in levels])  # [C]; candidate ids, -1 = root
    depth = torch.cat([torch.full_like(level.seq, d + 1) for d, level in enumerate(levels)])  # [C]
    order = torch.cat([level.order for level in levels])  # [C]
    rank = _rank_within_sequence(seq, batch, torch.cat([level.score for level in levels]), depth, order)
    kept = (rank < max_drafts[seq]).nonzero().squeeze(1)
    # Layout: by sequence, then depth, then draw order, so parents precede children and
    # siblings stay in the order they were drawn (the order the verifier tries them).
    layout = kept[_lexsort(seq[kept], depth[kept], order[kept])]  # [num_kept]
    counts = torch.bincount(seq[layout], minlength=batch)
    local = torch.full_like(seq, -1)
    local[layout] = (
        torch.arange(layout.shape[0], device=seq.device) - (counts.cumsum(0) - counts)[seq[layout]] + 1
    )
    parent_local = torch.where(parent >= 0, local[parent.clamp(min=0)], 0)

    q = _QRows(*(torch.cat([getattr(r, f) for r in q_rows]) for f in ("owner", "seq", "ids", "probs")))
    with_children = torch.zeros(seq.shape[0] + 1, dtype=torch.bool, device=seq.device)
    with_children[torch.where(parent[kept] >= 0, parent[kept], seq.shape[0])] = True  # slot C = "some root"
    roots_with_children = torch.zeros(batch, dtype=torch.bool, device=seq.device)
    roots_with_children[seq[kept][parent[kept] < 0]] = True
    owned = q.owner >= 0
    q_keep = (
        torch.where(owned, with_children[q.owner.clamp(min=0)], roots_with_children[q.seq])
        .nonzero()
        .squeeze(1)
    )
    node_of_row = torch.where(owned, local[q.owner.clamp(min=0)], 0)  # [rows]; local node
    q_node = node_of_row[q_keep]
    q_layout = q_keep[_lexsort(q.seq[q_keep], q_node)]  # [num_kept_rows]
    q_counts = torch.bincount(q.seq[q_layout], minlength=batch).tolist()

    split = counts.tolist()
    tokens = torch.split(torch.cat([level.token for level in levels])[layout].cpu(), split)
    parents = torch.split(parent_local[layout].cpu(), split)
    q_nodes = torch.split(node_of_row[q_layout].cpu(), q_counts)
    q_ids = torch.split(q.ids[q_layout].cpu(), q_counts)
    q_probs = torch.split(q.probs[q_layout].float().cpu(), q_counts)
    trees = []
    for b, update in enumerate(updates):
        if split[b] == 0:
            trees.append(root_only_tree(update))
            continue
        k = _q_width(budgets[b], modes[b])
        trees.append(
            CandidateTree(
                seq_id=update.seq_id,
                round=update.round,
                tokens=torch.cat([update.new_tokens[-1:].cpu(), tokens[b]]),
                parents=torch.cat([torch.tensor([-1]), parents[b]]),
                q_nodes=q_nodes[b],
                q_token_ids=q_ids[b][:, :k].contiguous(),
                q_probs=q_probs[b][:, :k].contiguous(),
                sampling=modes[b],
            )
        )
    return trees
