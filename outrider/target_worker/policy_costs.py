"""The speculation policy's cost fits (`spec_policy`): a decayed non-negative least-squares fit,
and a round's seconds outside the drafter's wait as two of them."""

from __future__ import annotations

from collections.abc import Sequence as Seq

import numpy as np


def nonnegative_solve(q: np.ndarray, c: np.ndarray, hint: np.ndarray | None = None) -> np.ndarray:
    """argmin over w >= 0 of w'Qw / 2 - c'w, Q positive definite (the normal equations of
    a least-squares fit): Lawson and Hanson's active set, on a handful of coefficients.

    Clipping the unconstrained solution at 0 instead is no fit at all where features move
    together: served at concurrency 1 (B always 1, so a and u B are one column) a server's
    first noisy rounds gave a = -1.6 ms, u = +2.7 ms; clipped, a round without drafts was
    priced 3.7 ms where it took 2.05, and speculation stayed off for hundreds of rounds.

    `hint`: the coefficients held at 0 by the last fit (a boolean mask). Refits move little
    between solves, so that set is tried first and kept where it is still optimal (the KKT
    conditions hold): one solve instead of the active set's several, where a coefficient is
    pinned at 0 for good (u at batch 1: ~0.2-0.4 ms a fit, 20% of the policy's time)."""
    w = np.linalg.solve(q, c)
    if (w >= 0).all():  # (one solve where no coefficient is pushed below 0)
        return w
    if hint is not None and hint.any() and not hint.all():
        idx, z = np.flatnonzero(~hint), np.zeros(len(c))
        z[idx] = np.linalg.solve(q[np.ix_(idx, idx)], c[idx])
        gradient = c - q @ z  # > 0 at a held coefficient: the objective would fall raising it
        if (z[idx] > 0).all() and (gradient[hint] <= 1e-12 * (abs(c).max() + 1e-300)).all():
            return z
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
        self.w = nonnegative_solve(lhs, self.xty + ridge * self.w, self.w == 0.0)
        self._coefficients = tuple(self.w.tolist())
        return self._coefficients

    def coefficients(self) -> tuple[float, ...]:
        return self._coefficients

    def predict(self, features: Seq[float]) -> float:
        """The last fit's y at these features."""
        return self._coefficients[0] + sum(
            w * x for w, x in zip(self._coefficients[1:], features, strict=True)
        )


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
        self._octaves: set[int] = set()  # B.bit_length() of the decode rounds fitted
        self._stale = False  # a row at a new octave since the last solve (`plain_seconds`)

    def add(
        self, features: Seq[float], round_s: float, forward_s: float | None = None, prefill: bool = False
    ) -> None:
        """`features`: (N, A, D, B), B the sequences verified (decoding ones)."""
        if not prefill:
            self._seen(features[3])
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
        for seqs_ in set(seqs[decode].tolist()):  # (not np.unique: ~0.2 ms a call here)
            self._seen(seqs_)
        timed = ~np.isnan(forward_s)
        fitted = timed & decode
        features = np.stack([tokens[fitted], seqs[fitted], np.zeros(int(fitted.sum()))], axis=1)
        self.forward.add_rows(features, forward_s[fitted])
        rest = round_s - np.where(timed, forward_s, 0.0)
        self.rest.add_rows(np.stack([tokens, np.zeros_like(tokens), np.zeros_like(tokens)], axis=1), rest)

    def _seen(self, seqs: float) -> None:
        octave = int(seqs).bit_length()
        if octave not in self._octaves:
            self._octaves.add(octave)
            self._stale = True

    def knows(self, num_seqs: int) -> bool:
        """Whether decode rounds of about this batch size (the same octave) were fitted."""
        return int(num_seqs).bit_length() in self._octaves

    def plain_seconds(self, num_seqs: float) -> float:
        """A decode round of `num_seqs` sequences without drafts: verify(B), fitted; refitted
        first where rounds of a batch size the last fit had not seen came in. At batch 1 a
        and u are one term (B = 1 in every row) and the fit keeps whatever split it had: a
        server whose first requests came one at a time priced its first rounds at batch 16
        2-3x their time (u 1.8 ms, from its warm-up), took them for rounds without drafts
        beating drafting, and vetoed it (draft_model over HTTP, concurrency 1 then 16)."""
        if self._stale:
            self.solve()
        a, b, _, _, u, _ = self._coefficients
        return a + (b + u) * num_seqs

    def solve(self) -> tuple[float, ...]:
        """(a, b, r, s, u, j)."""
        self._stale = False
        (a1, b1, u, j), (a2, b2, r, s) = self.forward.solve(), self.rest.solve()
        self._coefficients = (a1 + a2, b1 + b2, r, s, u, j)
        return self._coefficients

    def coefficients(self) -> tuple[float, ...]:
        return self._coefficients

    def predict(self, features: Seq[float]) -> float:
        """The round's seconds at `features` (N, A, D, B), as fitted."""
        (tokens, asked, drafted, seqs), (a, b, r, s, u, j) = features, self._coefficients
        return a + b * tokens + r * asked + s * drafted + u * seqs + j * lone_step(tokens, seqs)


def lone_step(tokens: float, seqs: float) -> float:
    """`RoundCost`'s J: 1 where a lone sequence's forward carries drafts."""
    return 1.0 if seqs == 1 and tokens > 1 else 0.0
