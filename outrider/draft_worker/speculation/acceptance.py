"""How often the target accepts a draft at each tree depth, counted from the real deltas.

Each real delta after a tree (`accepted path + one token`) walks that tree from the root: every
depth it reaches counts as tried, every node it matches as accepted. Rates start from a 0.7
prior and are kept over all sequences and per sequence; outcome ranking (`outcomes.py`)
multiplies them along a path.
"""

from __future__ import annotations

from outrider.proto import CandidateTree


class AcceptanceModel:
    """How often the target accepts a draft at each depth, counted from real deltas: over all
    sequences, and per sequence, whose own counts pull away from the global rate as they grow
    (one prompt the drafter predicts perfectly and one it never does share a drafter)."""

    PRIOR, PRIOR_WEIGHT = 0.7, 2.0
    GLOBAL_WEIGHT = 4.0  # a sequence's own rounds that weigh as much as the global rate

    def __init__(self) -> None:
        self.reached: list[int] = []  # [depth - 1] rounds whose accepted path reached the parent depth
        self.accepted: list[int] = []  # [depth - 1] ... and accepted a node at this depth
        self._per_seq: dict[int, tuple[list[int], list[int]]] = {}  # seq_id -> (reached, accepted)

    def rate(self, depth: int, seq_id: int | None = None) -> float:
        """P(a node at `depth` >= 1 is accepted | its parent was), for `seq_id` if given."""
        i = depth - 1
        seen, kept = _counts(self.reached, self.accepted, i)
        overall = (kept + self.PRIOR * self.PRIOR_WEIGHT) / (seen + self.PRIOR_WEIGHT)
        if seq_id is None or seq_id not in self._per_seq:
            return overall
        seen, kept = _counts(*self._per_seq[seq_id], i)
        return (kept + overall * self.GLOBAL_WEIGHT) / (seen + self.GLOBAL_WEIGHT)

    def observe(self, tree: CandidateTree, delta: list[int], seq_id: int | None = None) -> None:
        """The real delta after `tree`: its accepted path (all but the last token) walks the tree."""
        counts = [(self.reached, self.accepted)]
        if seq_id is not None:
            counts.append(self._per_seq.setdefault(seq_id, ([], [])))
        children = tree_children(tree)
        tokens = tree.tokens.tolist()
        node, depth = 0, 0
        for token in [*delta[:-1], None]:
            kids = children.get(node, [])
            if not kids:
                return  # a leaf: nothing was rejected below it
            match = next((k for k in kids if tokens[k] == token), None)
            for reached, accepted in counts:
                while len(reached) <= depth:
                    reached.append(0)
                    accepted.append(0)
                reached[depth] += 1
                accepted[depth] += match is not None
            if match is None:
                return
            node, depth = match, depth + 1

    def forget(self, seq_id: int) -> None:
        self._per_seq.pop(seq_id, None)


def _counts(reached: list[int], accepted: list[int], i: int) -> tuple[int, int]:
    return (reached[i], accepted[i]) if i < len(reached) else (0, 0)


def tree_children(tree: CandidateTree) -> dict[int, list[int]]:
    """{node: its children, in node order}; leaves are absent."""
    children: dict[int, list[int]] = {}
    for node, parent in enumerate(tree.parents.tolist()[1:], start=1):
        children.setdefault(parent, []).append(node)
    return children
