"""Verify outcomes worth pre-drafting: the likeliest (accepted path, bonus token) pairs of a tree.

A real delta is `accepted path + one token`. For each node the accepted path may end at,

    P(end at node) = P(reach node) * (1 - acc(depth + 1))     (* 1 at a leaf)
    P(reach node)  = prod over its path of acc(depth) * (its q / its siblings' q)

and the token after it is a bonus drawn from the node's q row minus its children (a child
that matched would have been accepted), renormalised. A leaf carries no q row unless the
proposer drafted outcome rows (`DraftHints.outcome_rows`); otherwise the proposer drafts a
probe from the state extended by the leaf's path, and its root q row names the bonus.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from outrider.draft_worker.proposer import DraftHints, Speculative
from outrider.draft_worker.speculation.acceptance import AcceptanceModel, tree_children
from outrider.proto import CandidateTree, SequenceUpdate


@dataclass(frozen=True)
class Outcome:
    score: float
    path: tuple[int, ...]  # accepted draft tokens (tree nodes below the root)
    bonus: int

    @property
    def delta(self) -> tuple[int, ...]:
        return (*self.path, self.bonus)


def q_rows(tree: CandidateTree) -> dict[int, dict[int, float]]:
    """Each expanded node's q as {token: probability}, padding dropped."""
    rows: dict[int, dict[int, float]] = {}
    ids, probs = tree.q_token_ids.tolist(), tree.q_probs.tolist()
    for row, node in enumerate(tree.q_nodes.tolist()):
        rows[node] = {t: p for t, p in zip(ids[row], probs[row], strict=True) if t >= 0 and p > 0}
    return rows


def next_round_update(update: SequenceUpdate, delta: tuple[int, ...]) -> SequenceUpdate:
    """The update of round r + 1 that `delta` would be, after round r's `update`."""
    return replace(
        update, round=update.round + 1, new_tokens=torch.tensor(delta, dtype=update.new_tokens.dtype)
    )


def rank_outcomes(
    update: SequenceUpdate,
    tree: CandidateTree,
    acceptance: AcceptanceModel,
    proposer: Speculative,
    *,
    max_outcomes: int,
    bonus_per_node: int,
    hints: DraftHints,
) -> list[Outcome]:
    """The `max_outcomes` most likely (accepted path, bonus token) pairs after `tree`, best first.

    Leaves without a q row are probed through `proposer.speculate` (with `hints`, so a real
    round can interrupt it: `SpeculationInterrupted` propagates); the probes' states are released.
    """
    rows, per_node = q_rows(tree), bonus_per_node
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    children = tree_children(tree)
    depth, reach, paths = [0], [1.0], [()]  # per node: depth, P(accepted path reaches it), path
    for node in range(1, len(tokens)):
        parent = parents[node]
        siblings = children[parent]
        row = rows.get(parent, {})
        mass = sum(row.get(tokens[s], 0.0) for s in siblings)
        share = row.get(tokens[node], 0.0) / mass if mass > 0 else 1 / len(siblings)
        depth.append(depth[parent] + 1)
        reach.append(reach[parent] * acceptance.rate(depth[node], update.seq_id) * share)
        paths.append((*paths[parent], tokens[node]))
    candidates: list[Outcome] = []
    leaves: list[tuple[float, tuple[int, ...]]] = []
    for node in range(len(tokens)):
        kids = {tokens[k] for k in children.get(node, [])}
        # The accepted path ends here: no child accepted (or none to accept).
        end = reach[node] * ((1 - acceptance.rate(depth[node] + 1, update.seq_id)) if kids else 1.0)
        if end <= 0:
            continue
        if node in rows:
            rest = 1 - sum(q for t, q in rows[node].items() if t in kids)  # q mass left to the bonus
            for token, q in _top(rows[node], kids, per_node):
                candidates.append(Outcome(end * q / max(rest, q), paths[node], token))
        elif not kids:
            leaves.append((end, paths[node]))
    # Leaves carry no q row: ask the drafter what follows each likely full path.
    leaves = sorted(leaves, reverse=True)[:max_outcomes]
    probes = [next_round_update(update, p) for _, p in leaves]
    drafted = proposer.speculate(update.seq_id, probes, hints) if probes else None
    for (prob, path), (probe_tree, probe_state) in zip(leaves, drafted or [], strict=False):
        proposer.release_state(probe_state)  # only its root q row is wanted
        root_row = q_rows(probe_tree).get(0, {})
        for token, q in _top(root_row, set(), per_node):
            candidates.append(Outcome(prob * q, path, token))
    candidates.sort(key=lambda o: (-o.score, len(o.path), o.delta))
    return candidates[:max_outcomes]


def _top(row: dict[int, float], exclude: set[int], count: int) -> list[tuple[int, float]]:
    ranked = sorted(((p, -t) for t, p in row.items() if t not in exclude), reverse=True)
    return [(-t, p) for p, t in ranked[:count]]
