"""The speculation policy's estimators (`spec_policy`): a decayed least-squares cost fit,
decayed per-depth counts of what a drafter drafts and what of it is kept, and what a budget
is expected to earn and cost from them."""

from __future__ import annotations

from collections.abc import Sequence as Seq

import numpy as np


class CostFit:
    """y = w . (1, x_1, .., x_n) by decayed least squares, every w >= 0.

    `add` only records the row (it runs every round: an append, ~1 us); `solve` (every few
    rounds) folds the rows recorded since into the sums with one matrix product and refits,
    and `coefficients` are the last fit's. A coefficient the data cannot tell apart (its
    feature has not varied lately) keeps its last estimate: a small ridge pulls it toward
    that, not toward 0.
    """

    def __init__(self, num_features: int, decay: float):
        size = num_features + 1
        self.decay = decay
        # The sums are kept undecayed, each round's row weighted by 1 / decay^t instead
        # (`_weight`), so a round adds its terms and touches nothing else.
        self.xtx = np.zeros((size, size))
        self.xty = np.zeros(size)
        self._rows: list[tuple[float, ...]] = []  # (weight, 1, x_1, .., x_n, y) not yet folded in
        self._weight = 1.0
        self.w = np.zeros(size)
        self._coefficients = tuple(float(v) for v in self.w)

    def add(self, features: Seq[float], y: float) -> None:
        self._weight /= self.decay
        self._rows.append((self._weight, 1.0, *features, y))
        if self._weight > 1e100 or len(self._rows) >= 1024:  # before the weight overflows
            self._fold()
            if self._weight > 1e100:
                self.xtx /= self._weight
                self.xty /= self._weight
                self._weight = 1.0

    def _fold(self) -> None:
        if not self._rows:
            return
        rows = np.array(self._rows)
        self._rows.clear()
        weight, x, y = rows[:, 0], rows[:, 1:-1], rows[:, -1]
        weighted = x.T * weight  # [size, rows]
        self.xtx += weighted @ x
        self.xty += weighted @ y

    def solve(self) -> tuple[float, ...]:
        self._fold()
        xtx, xty = self.xtx / self._weight, self.xty / self._weight
        ridge = 1e-6 * (np.trace(xtx) + 1.0) * np.eye(len(xty))
        self.w = np.maximum(np.linalg.solve(xtx + ridge, xty + ridge @ self.w), 0.0)
        self._coefficients = tuple(float(v) for v in self.w)
        return self._coefficients

    def coefficients(self) -> tuple[float, ...]:
        return self._coefficients


class DraftCounts:
    """Decayed per-depth counts (index d is depth d + 1): asked[d] drafts that could reach
    depth d + 1 (the budget allowed it and the tree reached depth d), drafted[d] of them did;
    tries[d] drafts that reached depth d + 1 with every token above it kept, kept[d] of them
    kept it too. One [4, K] array (rows in that order): a round decays it in one call."""

    def __init__(self, counts: np.ndarray):
        self.counts = counts

    @classmethod
    def empty(cls, depth: int) -> DraftCounts:
        return cls(np.zeros((4, depth)))

    asked = property(lambda self: self.counts[0])
    drafted = property(lambda self: self.counts[1])
    tries = property(lambda self: self.counts[2])
    kept = property(lambda self: self.counts[3])

    def add(self, budget_depth: int, tree_depth: int, accepted: int, decay: float) -> None:
        reached = min(accepted + 1, tree_depth)  # depths tried: all kept ones and the first lost
        counts = self.counts
        counts *= decay
        counts[0, : min(tree_depth + 1, budget_depth)] += 1
        counts[1, :tree_depth] += 1
        counts[2, :reached] += 1
        counts[3, :accepted] += 1


def shrunk_rates(
    own: list[DraftCounts | None], glob: DraftCounts, hits: str, trials: str, first: float, prior: float
) -> np.ndarray:
    """[B, K]: per sequence and depth, its counts' `hits` / `trials` plus `prior`
    pseudo-observations of an anchor: the batch-wide rate at that depth (`glob`), itself shrunk
    toward the sequence's own rate at the depth above (`first` above depth 1). So a new
    sequence starts from the batch, and an undrafted depth is expected to do about as well
    as the one above it."""
    zero = np.zeros_like(glob.tries)
    num = np.stack([getattr(o, hits) if o is not None else zero for o in own])
    den = np.stack([getattr(o, trials) if o is not None else zero for o in own])
    glob_num, glob_den = getattr(glob, hits), getattr(glob, trials)
    rate = np.empty_like(num)
    above = np.full(len(own), first)
    for d in range(num.shape[1]):
        anchor = (glob_num[d] + prior * above) / (glob_den[d] + prior)
        rate[:, d] = above = (num[:, d] + prior * anchor) / (den[:, d] + prior)
    return rate


def expected_gains(
    own: list[DraftCounts | None],
    glob: DraftCounts,
    prior: float,
    deepest_seen: int,
    width: float,
    budget_nodes: np.ndarray,
) -> np.ndarray:
    """[B, 3, K + 1]: per sequence (`own` counts, None for a new one) and depth budget
    0 .. K, the expected committed tokens, the expected nodes verified, and the chance the
    tree has any draft at all.

    Two rates per sequence and depth d (`shrunk_rates`, `prior` pseudo-observations): that
    the drafter drafts depth d when its budget allows (a lookup drafter often matches
    nothing, or less than asked), and that a drafted token at depth d is kept (all above it
    kept). Then

        tokens(k) = 1 + sum_{i <= k} prod_{d <= i} drafts_d keeps_d
        nodes(k)  = 1 + min(width x sum_{i <= k} prod_{d <= i} drafts_d, budget_nodes[k] - 1)

    `width`: the draft nodes per depth the drafter's trees carried. Depths past
    `deepest_seen` + 1 (the deepest tree ever drafted, and one more to find out) earn nothing."""
    drafts = shrunk_rates(own, glob, "drafted", "asked", 1.0, prior)  # [B, K]
    keeps = shrunk_rates(own, glob, "kept", "tries", 0.5, prior)
    keeps[:, max(deepest_seen + 1, 1) :] = 0.0
    ones = np.ones((len(own), 1))
    tokens = np.concatenate([ones, 1.0 + np.cumsum(np.cumprod(drafts * keeps, axis=1), axis=1)], axis=1)
    depth = np.cumsum(np.cumprod(drafts, axis=1), axis=1)  # expected depth drafted
    nodes = 1.0 + np.minimum(width * depth, budget_nodes[None, 1:] - 1.0)
    some = np.repeat(drafts[:, :1], drafts.shape[1], axis=1)
    return np.stack(
        [tokens, np.concatenate([ones, nodes], axis=1), np.concatenate([0 * ones, some], axis=1)], axis=1
    )
