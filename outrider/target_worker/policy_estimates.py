"""The speculation policy's estimators (`spec_policy`): decayed per-depth counts of what a
drafter drafts and what of it is kept, and what a budget is expected to earn and cost from
them (the cost fits: `policy_costs`)."""

from __future__ import annotations

from collections.abc import Sequence as Seq

import numpy as np


class DraftCounts:
    """Decayed per-depth counts (index d is depth d + 1): asked[d] drafts that could reach
    depth d + 1 (the budget allowed it and the tree reached depth d), drafted[d] of them did;
    tries[d] drafts that reached depth d + 1 with every token above it kept, kept[d] of them
    kept it too.

    Kept undecayed as Python floats, each draft weighted by 1 / decay^t instead (as `CostFit`):
    `add` (every sequence, every round it drafts) adds to four prefixes and decays nothing;
    `counts` divides once, when the estimates are refreshed."""

    def __init__(self, depth: int):
        self._sums = [[0.0] * depth for _ in range(4)]
        self._weight = 1.0

    @classmethod
    def empty(cls, depth: int) -> DraftCounts:
        return cls(depth)

    @property
    def counts(self) -> list[list[float]]:
        """[4][K]: asked, drafted, tries, kept."""
        scale = 1.0 / self._weight
        return [[v * scale for v in row] for row in self._sums]

    depth = property(lambda self: len(self._sums[0]))
    first_keeps = property(lambda self: (self._sums[2][0] / self._weight, self._sums[3][0] / self._weight))
    asked = property(lambda self: self.counts[0])
    drafted = property(lambda self: self.counts[1])
    tries = property(lambda self: self.counts[2])
    kept = property(lambda self: self.counts[3])

    def add(self, budget_depth: int, tree_depth: int, accepted: int, decay: float) -> None:
        reached = min(accepted + 1, tree_depth)  # depths tried: all kept ones and the first lost
        self._weight /= decay
        w, sums = self._weight, self._sums
        for row, n in zip(
            sums, (min(tree_depth + 1, budget_depth), tree_depth, reached, accepted), strict=True
        ):
            for d in range(n):
                row[d] += w
        if w > 1e100:  # (before the weights overflow)
            self._bound()

    def _bound(self) -> None:
        """Divides the weight out of the sums (before it overflows)."""
        w = self._weight
        self._sums = [[v / w for v in row] for row in self._sums]
        self._weight = 1.0

    def add_round(self, drafts: Seq[tuple[int, int, int]], decay: float) -> None:
        """`add` of a round's drafts, (budget depth, tree depth, kept) each, weighed alike (the
        weight of the round's last): one pass per count, not per draft and depth (the batch-wide
        counts take every drafting sequence's: at batch 64, ~0.1 ms a round that way, draft by
        draft ~0.3)."""
        if not drafts:
            return
        self._weight /= decay ** len(drafts)
        depth, w, sums = len(self._sums[0]), self._weight, self._sums
        ends = [[0] * (depth + 1) for _ in range(4)]  # [count][n]: drafts that reach n
        for budget_depth, tree_depth, accepted in drafts:
            ends[0][min(tree_depth + 1, budget_depth, depth)] += 1
            ends[1][min(tree_depth, depth)] += 1
            ends[2][min(accepted + 1, tree_depth, depth)] += 1
            ends[3][min(accepted, depth)] += 1
        for row, reach in zip(sums, ends, strict=True):
            beyond = 0
            for d in range(depth - 1, -1, -1):
                beyond += reach[d + 1]
                if beyond:
                    row[d] += w * beyond
        if w > 1e100:
            self._bound()


# A sequence's expected (tokens, nodes, chance of any draft) per depth budget 0 .. K.
Row = tuple[list[float], list[float], list[float]]
# A verified draft: seq_id, budget depth, tree depth, kept, committed.
Outcome = tuple[int, int, int, int, int]


def _shrunk(
    num: list[float],
    den: list[float],
    glob_num: list[float],
    glob_den: list[float],
    first: float,
    prior: float,
    own_prior: float | None = None,
) -> list[float]:
    """One sequence's `shrunk_rates` row, on Python floats (a handful per depth: at the
    batches a round's policy refreshes, numpy's per-call cost on arrays this small was most
    of the work, ~2 us a call on this CPU); `own_prior` (default `prior`): the anchor's weight
    against the sequence's own counts."""
    rates, above, weight = [], first, prior if own_prior is None else own_prior
    for n, m, gn, gm in zip(num, den, glob_num, glob_den, strict=True):
        anchor = (gn + prior * above) / (gm + prior)
        above = (n + weight * anchor) / (m + weight)
        rates.append(above)
    return rates


def shrunk_rates(
    own: list[DraftCounts | None], glob: DraftCounts, hits: str, trials: str, first: float, prior: float
) -> np.ndarray:
    """[B, K]: per sequence and depth, its counts' `hits` / `trials` plus `prior`
    pseudo-observations of an anchor: the batch-wide rate at that depth (`glob`), itself shrunk
    toward the sequence's own rate at the depth above (`first` above depth 1). So a new
    sequence starts from the batch, and an undrafted depth is expected to do about as well
    as the one above it."""
    glob_num, glob_den = getattr(glob, hits), getattr(glob, trials)
    zero = [0.0] * len(glob_num)
    return np.array(
        [
            _shrunk(
                getattr(o, hits) if o else zero,
                getattr(o, trials) if o else zero,
                glob_num,
                glob_den,
                first,
                prior,
            )
            for o in own
        ]
    )


def expected_gains(
    own: list[DraftCounts | None],
    glob: DraftCounts,
    prior: float,
    deepest_seen: int,
    width: float,
    budget_nodes: Seq[float],
    keep_prior: float | None = None,
) -> list[tuple[list[float], list[float], list[float]]]:
    """Per sequence (`own` counts, None for a new one), three lists over the depth budget
    0 .. K: the expected committed tokens, the expected nodes verified, and the chance the
    tree has any draft at all.

    Two rates per sequence and depth d (`shrunk_rates`, `prior` pseudo-observations): that
    the drafter drafts depth d when its budget allows (a lookup drafter often matches
    nothing, or less than asked), and that a drafted token at depth d is kept (all above it
    kept). Then

        tokens(k) = 1 + sum_{i <= k} prod_{d <= i} drafts_d keeps_d
        nodes(k)  = 1 + min(width x sum_{i <= k} prod_{d <= i} drafts_d, budget_nodes[k] - 1)

    `width`: the draft nodes per depth the drafter's trees carried. Depths past
    `deepest_seen` + 1 (the deepest tree ever drafted, and one more to find out) earn nothing.
    `keep_prior` (default `prior`): the batch-wide keep rate's weight against a sequence's own
    (`spread_prior`)."""
    g = glob.counts  # asked, drafted, tries, kept
    cap = [float(n) - 1.0 for n in list(budget_nodes)[1:]]
    zero = [[0.0] * len(g[0])] * 4
    rows = []
    for o in own:
        c = o.counts if o else zero
        drafts = _shrunk(c[1], c[0], g[1], g[0], 1.0, prior)
        keeps = _shrunk(c[3], c[2], g[3], g[2], 0.5, prior, keep_prior)
        tokens, nodes, survive, reach, depth = [1.0], [1.0], 1.0, 1.0, 0.0
        for d, (drafted, kept) in enumerate(zip(drafts, keeps, strict=True)):
            survive *= drafted * (kept if d <= deepest_seen else 0.0)
            reach *= drafted
            depth += reach  # expected depth drafted
            tokens.append(tokens[-1] + survive)
            nodes.append(1.0 + min(width * depth, cap[d]))
        rows.append((tokens, nodes, [0.0] + [drafts[0]] * len(drafts)))
    return rows


def spread_prior(own: Seq[DraftCounts], glob: DraftCounts, floor: float, cap: float) -> float | None:
    """The pseudo-observations of the batch-wide keep rate a sequence's own counts are weighed
    against, from how far the live sequences' depth-1 keep rates spread beyond their counts'
    own noise (empirical Bayes, beta-binomial moments: between-sequence variance tau^2 = p(1 -
    p) / (prior + 1)), within [floor, cap]; None with fewer than 4 sequences holding a try.

    Sequences that keep alike (a replay drafter's fixed a: the spread is all noise) are
    weighed as the batch: with the floor alone, a noisy few misses sent one to depth 0 and a
    lucky one to 4, and as tokens(k) is concave the mix kept fewer tokens than depth 2 for
    all at the same cost (replay a = 0.7, batch 16). Sequences that differ (a lookup drafter
    on repetitive text beside fresh text) keep the floor's weight. Each count is a decayed
    one, taken as that many tries: noise overstated, if anything, and the spread under."""
    p_tries, p_kept = glob.first_keeps
    if p_tries <= 0:
        return None
    rate = p_kept / p_tries
    var, n_sum, spread, seqs = rate * (1.0 - rate), 0.0, 0.0, 0
    for counts in own:
        tries, kept = counts.first_keeps
        if tries >= 1.0:
            seqs, n_sum, spread = seqs + 1, n_sum + tries, spread + (kept - tries * rate) ** 2 / tries
    if seqs < 4:
        return None
    between = (spread - seqs * var) / n_sum  # tau^2
    return cap if between * (cap + 1.0) <= var else max(floor, var / between - 1.0)


def moved(row: Row, old: Row) -> bool:
    """Whether a refreshed row differs from the one a choice was made with by more than 1% of
    its deepest expected tokens anywhere."""
    scale = 0.01 * max(row[0][-1], 1.0)
    return any(
        abs(x - y) > scale for new, was in zip(row, old, strict=True) for x, y in zip(new, was, strict=True)
    )


def sequence_seconds(
    rows: list[Row], b: float, ask: float, overhead: float, g: float, h: float = 0.0
) -> list[list[float]]:
    """Per sequence and depth k, the round seconds it adds: b per node verified, and once it
    drafts, ask (its delta and answer), overhead x the chance its tree has drafts, g per
    token it commits (drafting every round, it sends what it commits to catch up on) and h
    per draft token it asks for (a batched draft model's step grows with the rows it drafts)."""
    return [
        [b * nodes[0]]
        + [
            b * n + ask + overhead * q + g * t + h * k
            for k, (t, n, q) in enumerate(zip(tokens[1:], nodes[1:], some[1:], strict=True), start=1)
        ]
        for tokens, nodes, some in rows
    ]


class RowSeconds:
    """`sequence_seconds` of each row, kept while the row (`SpeculationPolicy._gain`'s, reused
    for rounds) and the cost terms are the same: at batch 64 working them out afresh at every
    choice was ~0.1 ms a round."""

    def __init__(self) -> None:
        self._terms: tuple[float, ...] = ()
        self._kept: dict[int, tuple[Row, list[float]]] = {}  # id(row) -> (row, its seconds)

    def __call__(self, rows: list[Row], terms: tuple[float, ...]) -> list[list[float]]:
        """`terms`: `sequence_seconds`' (b, ask, overhead, g, h)."""
        if terms != self._terms or len(self._kept) > 4 * len(rows) + 64:
            self._terms, self._kept = terms, {}
        kept, out = self._kept, []
        for row in rows:
            known = kept.get(id(row))
            if known is None or known[0] is not row:  # (the row held: its id is not reused meanwhile)
                known = kept[id(row)] = (row, sequence_seconds([row], *terms)[0])
            out.append(known[1])
        return out


def forwarded(rows: list[Row], depths: Seq[int]) -> float:
    """The nodes a choice of depths is expected to put in the forward (roots included)."""
    return sum(row[1][k] for row, k in zip(rows, depths, strict=True))


def dinkelbach(
    rows: list[Row], seconds: list[list[float]], ceiling: Seq[int], m: int, base_s: float, lam: float
) -> tuple[float, list[int]]:
    """The depths (each <= its ceiling and m) maximising the batch's committed tokens per
    second, sum tokens / (base_s + sum seconds), and that rate: Dinkelbach's iteration (for a
    rate lam each sequence takes the depth maximising tokens - lam x seconds; lam <- the rate
    that achieves), from `lam` (the last choice's rate: two or three iterations). Python
    floats: on a handful of values a numpy call costs more than the arithmetic it does."""
    if m == 0:  # (nothing to choose: every sequence verifies its root)
        total = base_s + sum(cost[0] for cost in seconds)
        return sum(gain[0] for gain, _, _ in rows) / max(total, 1e-9), [0] * len(rows)
    for _ in range(4):
        choice, tokens, total = [], 0.0, base_s
        for (gain, _, _), cost, cap in zip(rows, seconds, ceiling, strict=True):
            k = 0
            for d in range(1, min(cap, m) + 1):
                if gain[d] - lam * cost[d] > gain[k] - lam * cost[k]:
                    k = d
            choice.append(k)
            tokens += gain[k]
            total += cost[k]
        rate = tokens / max(total, 1e-9)
        settled, lam = abs(rate - lam) <= 1e-4 * max(rate, 1.0), rate
        if settled:
            break
    return lam, choice
