"""Medusa's tree: a list of paths of per-head ranks, compiled into tree buffers once.

The tree is data (docs/architecture.md, "How the code reads"): `(0, 2)` = the rank-2 token of head 1 under the top token of
head 0. `StaticTree.compile` lays the paths out as buffers at start-up, and `cut` keeps, per
round, what a smaller TreeBudget allows: the first paths in priority order, prefix-closed.

    choices  (0,) (1,) (0, 0) (2,) (0, 1) (1, 0) (0, 0, 0)

    node     0     1     2     3     4       5       6       7
    path     ()    (0,)  (1,)  (2,)  (0, 0)  (0, 1)  (1, 0)  (0, 0, 0)
    parent   -1    0     0     0     1       1       2       4

Without `medusa_choices` the tree is the best one for the budget under the heads' measured
top-k accuracies (`medusa_accuracy` in config.json, written by training) or `prior_accuracy`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from outrider.proto import TreeBudget

RankPath = tuple[int, ...]  # one tree node: ranks of heads 0, 1, ... on the way from the root


# Top-k accuracy of head d at rank r when a checkpoint has no measured table (Medusa-1 heads on
# Vicuna-7B are roughly 0.6 / 0.45 / 0.35 / 0.3 at rank 0, each further rank a fraction of that).
def prior_accuracy(num_heads: int, ranks: int = 10) -> list[list[float]]:
    return [
        [0.6 * 0.75**d * (0.35 if r else 1.0) * 0.7 ** max(r - 1, 0) for r in range(ranks)]
        for d in range(num_heads)
    ]


def best_choices(accuracy: Sequence[Sequence[float]], budget: TreeBudget) -> list[RankPath]:
    """The max_nodes - 1 paths of highest value (product of accuracy[depth][rank] along the path),
    best first: Medusa's tree search under independent per-head accuracies. Values never grow
    along a path and ties go to the shallower, lower-ranked path, so every prefix of the result
    is prefix-closed."""
    depth, width = min(budget.max_depth, len(accuracy)), budget.top_k
    frontier: list[tuple[float, RankPath]] = [(1.0, ())]
    chosen: list[tuple[float, RankPath]] = []
    while frontier and len(chosen) < budget.max_nodes - 1:
        value, path = frontier.pop(0)
        if path:
            chosen.append((value, path))
        if len(path) < depth:
            row = accuracy[len(path)]
            frontier += [(value * row[r], (*path, r)) for r in range(min(width, len(row)))]
            frontier.sort(key=lambda item: (-item[0], len(item[1]), item[1]))
    return [path for _, path in chosen]


@dataclass(frozen=True)
class StaticTree:
    """A prefix-closed list of paths laid out as tree buffers; node 0 is the root.

    Layout: by depth, then by ranks, so parents precede children and siblings go in rank order
    (the order the verifier tries them).
    """

    paths: tuple[RankPath, ...]  # [N - 1] in priority order (what a smaller budget keeps first)
    parents: torch.Tensor  # [N] int64; -1 for the root
    depth: torch.Tensor  # [N] int64; head of a non-root node = depth - 1
    rank: torch.Tensor  # [N] int64; rank of the node within its head (root: 0)
    sibling: torch.Tensor  # [N] int64; position among its siblings, in rank order
    expanded: torch.Tensor  # [E] int64; nodes with children (each gets a q row)
    q_width: int  # entries per q row: the largest rank used + 1
    head: torch.Tensor  # [N] int64; the head a node's token comes from (depth - 1; root: 0)
    below: torch.Tensor  # [E] int64; the head an expanded node's children come from (its depth)
    parent_slot: torch.Tensor  # [N] int64; row in `expanded` of each node's parent (root: 0)
    max_depth: int

    @classmethod
    def compile(cls, choices: Sequence[Sequence[int]], num_heads: int) -> StaticTree:
        given = [tuple(int(r) for r in path) for path in choices]
        position = {}
        for i, path in enumerate(given):
            if not path or min(path) < 0 or len(path) > num_heads:
                raise ValueError(f"medusa_choices: {list(path)} must be 1..{num_heads} ranks >= 0")
            if path in position:
                raise ValueError(f"medusa_choices: {list(path)} appears twice")
            position[path] = i
        for path in given:
            if len(path) > 1 and path[:-1] not in position:
                raise ValueError(f"medusa_choices: {list(path)} comes without its prefix {list(path[:-1])}")
        # Priority = the given order, except that a path waits for its prefixes (published lists
        # need not list prefixes first), so every priority prefix is prefix-closed.
        after = {p: max(position[p[:i]] for i in range(1, len(p) + 1)) for p in given}
        paths = tuple(sorted(given, key=lambda p: (after[p], len(p))))
        layout = [(), *sorted(paths, key=lambda p: (len(p), p))]
        index = {path: i for i, path in enumerate(layout)}
        parents = [-1] + [index[p[:-1]] for p in layout[1:]]
        sibling, seen = [0], {}
        for p in layout[1:]:
            sibling.append(seen.get(p[:-1], 0))
            seen[p[:-1]] = sibling[-1] + 1
        expanded = sorted(set(parents[1:]))
        slot = {node: row for row, node in enumerate(expanded)}
        depth = [len(p) for p in layout]
        return cls(
            paths=paths,
            parents=torch.tensor(parents),
            depth=torch.tensor(depth),
            rank=torch.tensor([p[-1] if p else 0 for p in layout]),
            sibling=torch.tensor(sibling),
            expanded=torch.tensor(expanded, dtype=torch.int64),
            q_width=1 + max((p[-1] for p in paths), default=-1),
            head=torch.tensor([max(d - 1, 0) for d in depth]),
            below=torch.tensor([depth[u] for u in expanded], dtype=torch.int64),
            parent_slot=torch.tensor([0] + [slot[u] for u in parents[1:]]),
            max_depth=max(depth),
        )

    def cut(self, budget: TreeBudget) -> StaticTree:
        """The paths a smaller budget keeps: in priority order, within depth and rank, prefix-closed."""
        kept: list[RankPath] = []
        for path in self.paths:
            if len(kept) == budget.max_nodes - 1:
                break
            fits = len(path) <= budget.max_depth and max(path) < budget.top_k
            if fits and (len(path) == 1 or path[:-1] in kept):
                kept.append(path)
        return StaticTree.compile(kept, max(len(p) for p in self.paths) if self.paths else 1)

    @property
    def num_nodes(self) -> int:
        return self.parents.shape[0]
