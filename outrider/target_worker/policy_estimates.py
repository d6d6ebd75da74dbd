"""The speculation policy's estimators (`spec_policy`): a decayed least-squares cost fit,
decayed per-depth counts of what a drafter drafts and what of it is kept, and what a budget
is expected to earn and cost from them."""

from __future__ import annotations

from collections.abc import Sequence as Seq

import numpy as np


def nonnegative_solve(q: np.ndarray, c: np.ndarray) -> np.ndarray:
    """argmin over w >= 0 of w'Qw / 2 - c'w, Q positive definite (the normal equations of
    a least-squares fit): Lawson and Hanson's active set, on a handful of coefficients.

    Clipping the unconstrained solution at 0 instead is no fit at all where features move
    together: served at concurrency 1 (B always 1, so a and u B are one column) a server's
    first noisy rounds gave a = -1.6 ms, u = +2.7 ms; clipped, a round without drafts was
    priced 3.7 ms where it took 2.05, and speculation stayed off for hundreds of rounds."""
    w = np.linalg.solve(q, c)
    if (w >= 0).all():  # (one solve where no coefficient is pushed below 0)
        return w
    n = len(c)
    w, free = np.zeros(n), np.zeros(n, dtype=bool)
    for _ in range(3 * n):
        gradient = c - q @ w  # the objective falls along +gradient[j] for a j held at 0
        gradient[free] = 0.0
        j = int(np.argmax(gradient))
        if gradient[j] <= 1e-12 * (abs(c).max() + 1e-300):
            break
        free[j] = True
        while True:
            z = np.zeros(n)
            idx = np.flatnonzero(free)
            z[idx] = np.linalg.solve(q[np.ix_(idx, idx)], c[idx])
            if (z[idx] > 0).all():
                w = z
                break
            # Step from w toward z as far as stays feasible; whatever reaches 0 is held there.
            falling = free & (z <= 0)
            step = min(1.0, float(np.min(w[falling] / (w[falling] - z[falling]))))
            w = w + step * (z - w)
            free &= w > 1e-15
            w[~free] = 0.0
    return w


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

    def add(self, features: Seq[float], y: float, elapsed: int = 1) -> None:
        """One row; `elapsed`: the rounds since the last row (a fit fed only on some rounds,
        as the drafter's wait, decays by rounds all the same: what it measured 600 rounds
        ago, say in a process's first requests, must not outweigh the last few rows)."""
        self._weight /= max(self.decay**elapsed, 1e-50)  # (beyond that the old rows weigh nothing)
        self._rows.append((self._weight, 1.0, *features, y))
        if self._weight > 1e100 or len(self._rows) >= 1024:  # before the weight overflows
            self._fold()
            if self._weight > 1e100:
                self.xtx /= self._weight
                self.xty /= self._weight
                self._weight = 1.0

    def add_rows(self, features: np.ndarray, y: np.ndarray) -> None:
        """`add` of several rows ([rows, n] features), in order, folded at once."""
        if not len(y):
            return
        self._fold()
        weights = self._weight / self.decay ** np.arange(1, len(y) + 1, dtype=float)
        self._weight = float(weights[-1])
        x = np.hstack([np.ones((len(y), 1)), features])
        weighted = x.T * weights
        self.xtx += weighted @ x
        self.xty += weighted @ y
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
        # The sums carry the decay weights' common factor: (xtx + ridge I) w = xty + ridge w_old
        # scaled by it, so the ridge is scaled instead of both sums.
        ridge = 1e-6 * (np.trace(self.xtx) + self._weight)
        lhs = self.xtx.copy()
        lhs.flat[:: len(lhs) + 1] += ridge
        self.w = nonnegative_solve(lhs, self.xty + ridge * self.w)
        self._coefficients = tuple(self.w.tolist())
        return self._coefficients

    def coefficients(self) -> tuple[float, ...]:
        return self._coefficients


class RoundCost:
    """A round's seconds outside `collect`, a + b N + u B + j J + r A + s D (N tokens in the forward, A
    sequences asked to draft, D of them with drafts), as two fits on what the engine times
    apart: the forward with verification (the model, target probabilities, the verify
    kernel: work per token) against N alone, and the rest of the round (checks, packing, the
    policy, commit, deltas: Python) against N, A and D; a and b are the sums of theirs.

    One fit of the whole round could not tell b from s: where every drafting sequence drafts
    the same depth (fixed K, or a policy that settled on one), N = B + k D, and the ridge
    kept whatever split the warm-up left. On the small family the forward of 9 tokens costs
    ~2.6 ms more than of 1 (b ~0.3 ms), but one fit read b = 0.07 ms and s = 2.7 ms: a batch of
    16 drafting sequences was priced 43 ms for what cost ~15, and the policy drafted for few of
    them (ngram at concurrency 64, T = 0: 1.20x off where fixed K = 4 ran 1.57x). The forward
    sees N vary with the batch as well as the depth, so its b is told apart.

    The forward's line is fitted on decode rounds only: on this CPU a 48-token prompt chunk
    cost little more than a 9-token tree (one matrix product either way), and with prefill
    rounds in the fit its slope read ~0.02 ms a token where a tree's tokens cost ~0.25 ms
    each at batch 1. Rounds given without their forward's time (`forward_s` None) go to the
    rest whole.
    On an accelerator the forward runs asynchronously: what it has not finished when
    verification returns is waited for later in the round, and lands in the rest's b.

    The forward's line has a term per sequence verified, u B, as well: in a served replica
    the round's outputs are streamed by the event loop's thread while the engine's thread
    runs the next forward, on the same core, so each sequence's chunk (its queue hand-off,
    serialisation, the stream) lengthens the forward whatever the sequence drafted. Fitted
    on tokens alone, that cost read as a cost per token and priced every draft token with it:
    over HTTP at concurrency 16-64 (draft_model and ngram co-located, T = 0) fixed K = 1-2
    ran 1.3-1.4x off where adaptive, drafting little, ran 1.1x. u is told from b where the
    batch's size moves apart from its tokens (requests come and go, depths vary); in one
    process at batch 1 it is part of a. It costs every sequence alike, so it enters the
    choice as a fixed cost of the round: more tokens a round amortise it.

    And a step j where a lone sequence's forward carries drafts (B = 1, N > 1): one row is a
    matrix-vector product, two or more a matrix product. On this CPU (small family, batch 1)
    the forward took 1.25 ms for 1 token, 1.86 for 2, 2.48 for 4, 3.46 for 9: +0.62 ms for
    the second token, ~0.23 for each after. Priced by one slope, a policy that was off saw
    only its 1-token rounds and its depth-1 probes (2 tokens), read b ~0.5 ms, priced a
    4-deep draft ~1 ms over its cost, and stayed off (ngram at T = 0, where fixed K = 4 ran
    1.34x plain) for ~400 rounds. The warm-up's depths 0 .. K tell j from b; rounds of 1 and
    2 tokens alone cannot, and leave the split as it was. At B > 1 the forward is a matrix
    product whether it drafts or not: no step (J = 0).
    """

    def __init__(self, decay: float):
        self.forward, self.rest = CostFit(3, decay), CostFit(3, decay)
        self._coefficients = (0.0, 0.0, 0.0, 0.0, 0.0, 0.0)

    def add(
        self, features: Seq[float], round_s: float, forward_s: float | None = None, prefill: bool = False
    ) -> None:
        """`features`: (N, A, D, B), B the sequences verified (decoding ones)."""
        if forward_s is not None:
            if not prefill:  # (a prompt chunk's tokens cost a fraction of a decode round's each)
                tokens, seqs = features[0], features[3]
                self.forward.add((tokens, seqs, lone_step(tokens, seqs)), forward_s)
            round_s -= forward_s
        self.rest.add(features[:3], round_s)

    def add_rows(
        self,
        tokens: np.ndarray,
        seqs: np.ndarray,
        round_s: np.ndarray,
        forward_s: np.ndarray,
        decode: np.ndarray,
    ) -> None:
        """`add` of several rounds in which nobody was asked to draft (features (N, 0, 0, B)),
        in order; `forward_s` NaN where not timed, `decode` False where prompt chunks rode along
        (so every fitted one has N = B: no lone step)."""
        timed = ~np.isnan(forward_s)
        fitted = timed & decode
        features = np.stack([tokens[fitted], seqs[fitted], np.zeros(int(fitted.sum()))], axis=1)
        self.forward.add_rows(features, forward_s[fitted])
        rest = round_s - np.where(timed, forward_s, 0.0)
        self.rest.add_rows(np.stack([tokens, np.zeros_like(tokens), np.zeros_like(tokens)], axis=1), rest)

    def plain_seconds(self, num_seqs: float) -> float:
        """A decode round of `num_seqs` sequences without drafts: verify(B), fitted."""
        a, b, _, _, u, _ = self._coefficients
        return a + (b + u) * num_seqs

    def solve(self) -> tuple[float, ...]:
        """(a, b, r, s, u, j)."""
        (a1, b1, u, j), (a2, b2, r, s) = self.forward.solve(), self.rest.solve()
        self._coefficients = (a1 + a2, b1 + b2, r, s, u, j)
        return self._coefficients

    def coefficients(self) -> tuple[float, ...]:
        return self._coefficients


def lone_step(tokens: float, seqs: float) -> float:
    """`RoundCost`'s J: 1 where a lone sequence's forward carries drafts."""
    return 1.0 if seqs == 1 and tokens > 1 else 0.0


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
        if w > 1e100:  # before the weights overflow
            self._sums = [[v / w for v in row] for row in sums]
            self._weight = 1.0


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


def dinkelbach(
    rows: list[Row], seconds: list[list[float]], ceiling: Seq[int], m: int, base_s: float, lam: float
) -> tuple[float, list[int]]:
    """The depths (each <= its ceiling and m) maximising the batch's committed tokens per
    second, sum tokens / (base_s + sum seconds), and that rate: Dinkelbach's iteration (for a
    rate lam each sequence takes the depth maximising tokens - lam x seconds; lam <- the rate
    that achieves), from `lam` (the last choice's rate: two or three iterations). Python
    floats: on a handful of values a numpy call costs more than the arithmetic it does."""
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
