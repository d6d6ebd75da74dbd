"""The speculation policy's estimators (`target_worker.policy_estimates`)."""

import numpy as np
import pytest

from outrider.target_worker.policy_estimates import CostFit, DraftCounts, expected_gains, shrunk_rates


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


def test_rates_start_from_the_batch_and_move_to_the_sequence():
    """A new sequence (no counts) gets the batch's rate; one with many of its own, its own."""
    glob, own = DraftCounts.empty(2), DraftCounts.empty(2)
    for _ in range(200):
        glob.add(2, 2, 2, decay=1.0)  # the batch: every draft kept
        own.add(2, 2, 0, decay=1.0)  # this sequence: every first token lost
    rates = shrunk_rates([None, own], glob, "kept", "tries", 0.5, prior=4.0)
    assert rates[0, 0] == pytest.approx(1.0, abs=0.03) and rates[1, 0] == pytest.approx(0.0, abs=0.03)
    assert np.all(rates >= 0) and np.all(rates <= 1)


def test_expected_gains_survive_along_the_draft_and_price_the_width_drafted():
    """A drafter that always drafts every depth and sees all of it kept: tokens(k) = 1 + k;
    its trees carry `width` nodes per depth, at most the budget's nodes; depths past the
    deepest tree ever drafted (+1) earn nothing."""
    glob = DraftCounts.empty(4)
    for _ in range(300):
        glob.add(4, 4, 4, 0.99)
    budget = np.array([1.0, 3.0, 5.0, 7.0, 9.0])
    tokens, nodes, some = expected_gains([None], glob, 4.0, 4, 2.0, budget)[0]
    assert tokens == pytest.approx([1, 2, 3, 4, 5], abs=0.1)  # the prior pulls depth 1 toward 0.5
    assert nodes == pytest.approx([1, 3, 5, 7, 9], abs=0.1) and some == pytest.approx(
        [0, 1, 1, 1, 1], abs=0.02
    )
    _, narrow, _ = expected_gains([None], glob, 4.0, 4, 0.5, budget)[0]
    assert narrow == pytest.approx([1, 1.5, 2, 2.5, 3], abs=0.05)
    shallow, _, _ = expected_gains([None], glob, 4.0, 1, 2.0, budget)[0]
    assert shallow == pytest.approx([1, 2, 3, 3, 3], abs=0.1)
