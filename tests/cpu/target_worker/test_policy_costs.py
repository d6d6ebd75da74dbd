"""The speculation policy's cost fits (`target_worker.policy_costs`)."""

import numpy as np
import pytest

from outrider.target_worker.policy_costs import CostFit, RoundCost, nonnegative_solve


def test_the_cost_fit():
    fit = CostFit(2, decay=1.0)
    for x in range(1, 20):
        fit.add((x, x % 3), 0.5 + 0.25 * x + 0.125 * (x % 3))
    assert fit.solve() == pytest.approx((0.5, 0.25, 0.125), rel=1e-3)
    for _ in range(50):
        fit.add((4, 1), 0.5 + 0.25 * 4 + 0.125)  # one point, over and over: the slopes stay
        fit.solve()
    assert fit.coefficients() == pytest.approx((0.5, 0.25, 0.125), rel=1e-2)


def test_the_cost_fit_forgets_old_rows_and_survives_long_runs_between_solves():
    """Rows are folded in at `solve` (or every 1024 unsolved rows); the decay weights grow as
    1 / decay^t and are rescaled before they overflow (decay 0.8: past 1e100 in ~1030 rows)."""
    fit = CostFit(1, decay=0.8)
    for x in range(3000):
        fit.add((x % 7,), 1.0 + 2.0 * (x % 7))  # never solved in between
    assert fit.solve() == pytest.approx((1.0, 2.0), rel=1e-3)
    for x in range(200):  # the cost changed: the decayed fit follows the recent rows
        fit.add((x % 5,), 3.0 + 0.5 * (x % 5))
        if x % 16 == 0:
            fit.solve()
    assert fit.solve() == pytest.approx((3.0, 0.5), rel=1e-3)


def test_nonnegative_solve_is_the_constrained_minimum():
    """Against every subset of coefficients held at 0 (the minimum over w >= 0 is the
    unconstrained minimum of some subset that is itself >= 0), features near-collinear in a
    third of the cases, as a and u B are at concurrency 1."""
    import itertools

    rng = np.random.default_rng(0)
    for trial in range(400):
        n = int(rng.integers(2, 6))
        a = rng.normal(size=(n + int(rng.integers(0, 5)), n))
        if trial % 3 == 0:
            a[:, 1] = a[:, 0] * (1 + 1e-3 * rng.normal(size=len(a)))
        q, c = a.T @ a + 1e-6 * np.eye(n), 3 * rng.normal(size=n)
        objective = lambda w, q=q, c=c: 0.5 * w @ q @ w - c @ w  # noqa: E731
        best = 0.0  # w = 0
        for keep in itertools.product([False, True], repeat=n):
            idx = np.flatnonzero(keep)
            if len(idx):
                z = np.zeros(n)
                z[idx] = np.linalg.solve(q[np.ix_(idx, idx)], c[idx])
                if (z >= 0).all():
                    best = min(best, objective(z))
        w = nonnegative_solve(q, c)
        assert (w >= 0).all()
        assert objective(w) == pytest.approx(best, abs=1e-9 * (1 + abs(best)))
        # A hint of the coefficients held at 0, right or wrong, finds the same optimum.
        for hint in (w == 0.0, rng.random(n) < 0.5, w != 0.0):
            hinted = nonnegative_solve(q, c, hint)
            assert (hinted >= 0).all()
            assert objective(hinted) == pytest.approx(best, abs=1e-9 * (1 + abs(best)))


def test_the_cost_fit_refits_instead_of_clipping_where_features_move_together():
    """y = 1 + 0.5 x with a second feature equal to the intercept's column but for a few
    rows: unconstrained, the noise splits them as (-1.6, +2.7)-like pairs; clipping the
    negative one at 0 mispriced every row by its size. A non-negative refit stays on the data."""
    rng = np.random.default_rng(1)
    fit = CostFit(2, decay=1.0)
    for i in range(200):
        x = float(rng.integers(1, 9))
        b = 1.0 if i % 50 else 2.0  # a sequence count that almost never moves
        y = 2.0 + 0.5 * x + rng.normal(0, 0.05) + (-1.0 if b == 2.0 else 0.0)  # pulls u negative
        fit.add((x, b), y)
    w = fit.solve()
    assert min(w) >= 0
    residuals = [abs(w[0] + w[1] * x + w[2] * 1.0 - (2.0 + 0.5 * x)) for x in range(1, 9)]
    assert max(residuals) < 0.1  # (clipped, the fit is off by the clipped coefficient's share)


def test_a_fit_fed_on_some_rounds_forgets_by_rounds():
    """The drafter's wait is measured only in rounds that draft: 50 rows at 2.5 ms (a
    server's first, noisy rounds), 600 rounds without drafts, then 3 rows at 0.5 ms. Decayed
    by rows, the old ones still outweigh the new; by rounds (`elapsed`), the new ones lead."""
    by_rows, by_rounds = CostFit(1, decay=0.98), CostFit(1, decay=0.98)
    for fit in (by_rows, by_rounds):
        for i in range(50):
            fit.add((float(i % 8 + 1),), 2.5e-3)
        fit.solve()
    for i in range(3):
        by_rows.add((float(i + 1),), 0.5e-3)
        by_rounds.add((float(i + 1),), 0.5e-3, elapsed=600 if i == 0 else 1)
    by_rows.solve(), by_rounds.solve()
    predict = lambda fit: fit.coefficients()[0] + 4 * fit.coefficients()[1]  # noqa: E731
    assert predict(by_rows) > 2e-3
    assert predict(by_rounds) == pytest.approx(0.5e-3, rel=0.05)


def test_rows_added_at_once_leave_the_sums_added_one_by_one_would():
    """`add_rows` (the quiet rounds' fold, `policy_quiet`) against `add`, across the rescaling
    of the decay weights (decay 0.8: past 1e100 every ~1030 rows)."""
    rng = np.random.default_rng(0)
    x = rng.integers(1, 17, size=(3000, 2)).astype(float)
    y = 1e-3 + 2e-4 * x[:, 0] + 5e-5 * x[:, 1] + rng.normal(0, 1e-5, 3000)
    one, many = CostFit(2, decay=0.8), CostFit(2, decay=0.8)
    for i in range(3000):
        one.add(tuple(x[i]), y[i])
        if (i + 1) % 500 == 0:
            one.solve()
    for start in range(0, 3000, 500):
        many.add_rows(x[start : start + 500], y[start : start + 500])
        many.solve()
    assert many.solve() == pytest.approx(one.solve(), rel=1e-9)
    assert many.xtx / many._weight == pytest.approx(one.xtx / one._weight, rel=1e-9)


def test_round_cost_tells_the_token_cost_from_the_drafting_sequence_cost():
    """Every drafting sequence drafts 8 (N = B + 8 D): one fit of the whole round cannot tell
    b from s; the forward, timed apart and fitted on its tokens, can. Prompt chunks, whose
    tokens cost a fraction of a tree's, stay out of the forward's line. A cost per sequence
    in the forward (a served replica streaming each sequence's chunk meanwhile) is told from
    the cost per token, not priced on every draft token."""
    cost = RoundCost(0.98)
    b, s, u, a_fwd, a_rest = 3e-4, 2e-4, 5e-4, 1e-3, 2e-4
    for batch in (1, 2, 4, 1, 3) * 10:
        for drafting in range(batch + 1):
            n = batch + 8 * drafting
            forward = a_fwd + b * n + u * batch
            cost.add((n, drafting, drafting, batch), forward + a_rest + s * drafting, forward)
        chunk = a_fwd + 2e-5 * (batch + 48) + u * batch
        cost.add((batch + 48, 0, 0, batch), chunk + a_rest, chunk, True)
    a, b_fit, r, s_fit, u_fit, j_fit = cost.solve()
    assert b_fit == pytest.approx(b, rel=0.05)
    assert u_fit == pytest.approx(u, rel=0.05)
    assert cost.plain_seconds(4) == pytest.approx(a_fwd + a_rest + (b + u) * 4, rel=0.05)
    assert r + s_fit == pytest.approx(s, rel=0.1)  # asked and drafting sequences: always together here
    assert a == pytest.approx(a_fwd + a_rest, rel=0.1)


def test_round_cost_tells_a_lone_sequences_step_from_its_tokens():
    """The small family's forward at batch 1 on this CPU, 1.25 ms for 1 token and ~0.62 ms
    more for a second, ~0.23 for each after (`RoundCost`): the warm-up's depths 0 .. 8 tell
    the step j from the slope b; a stretch of 1- and 2-token rounds alone (speculation off,
    depth-1 probes) leaves the split where it was, so a deep draft is still priced at its
    cost. One slope, fitted on that stretch, read ~0.6 ms a token."""

    def forward(n: int) -> float:
        return 1.02e-3 + 0.23e-3 * n + (0.39e-3 if n > 1 else 0.0)

    cost = RoundCost(0.98)
    for _ in range(3):  # warm-up: every depth
        for depth in range(9):
            cost.add((1 + depth, 1, 1, 1), forward(1 + depth) + 1e-4, forward(1 + depth))
    for i in range(300):  # off, a depth-1 probe every 16 rounds
        n = 2 if i % 16 == 0 else 1
        cost.add((n, n - 1, n - 1, 1), forward(n) + 1e-4, forward(n))
        if i % 50 == 0:
            cost.solve()
    a, b, _, _, u, j = cost.solve()
    assert b == pytest.approx(0.23e-3, rel=0.1) and j == pytest.approx(0.39e-3, rel=0.1)
    assert a + b * 5 + u + j == pytest.approx(forward(5) + 1e-4, rel=0.03)  # a 4-deep draft


def test_rounds_of_a_batch_size_the_fit_has_not_seen_are_priced_after_a_refit():
    """At batch 1 the round's fixed cost and its cost per sequence are one term (B = 1 in every
    row): the fit keeps a split that says nothing of batch 16. The first rounds of 16 sequences
    are priced by a refit that has them, not by that split."""
    cost = RoundCost(0.98)

    def forward_s(seqs: int) -> float:
        return 2e-3 + 3e-4 * seqs  # a round of `seqs` sequences without drafts

    for _ in range(50):
        cost.add((1, 0, 0, 1), forward_s(1), forward_s(1))
    cost.solve()
    assert cost.plain_seconds(1) == pytest.approx(forward_s(1), rel=0.01)
    assert cost.plain_seconds(16) > 2 * forward_s(16)  # the batch-1 split, extrapolated
    assert not cost.knows(16)
    cost.add((16, 0, 0, 16), forward_s(16), forward_s(16))
    assert cost.knows(16) and cost.knows(31) and not cost.knows(32)  # (an octave: 16 .. 31)
    assert cost.plain_seconds(16) == pytest.approx(forward_s(16), rel=0.05)  # (no `solve` called)
