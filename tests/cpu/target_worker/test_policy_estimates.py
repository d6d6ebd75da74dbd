"""The speculation policy's estimators (`target_worker.policy_estimates`)."""

import numpy as np
import pytest

from outrider.target_worker.policy_estimates import CostFit, DraftCounts, shrunk_rates


def test_the_cost_fit():
    fit = CostFit(2, decay=1.0)
    for x in range(1, 20):
        fit.add((x, x % 3), 0.5 + 0.25 * x + 0.125 * (x % 3))
    assert fit.solve() == pytest.approx((0.5, 0.25, 0.125), rel=1e-3)
    for _ in range(50):
        fit.add((4, 1), 0.5 + 0.25 * 4 + 0.125)  # one point, over and over: the slopes stay
        fit.solve()
    assert fit.coefficients() == pytest.approx((0.5, 0.25, 0.125), rel=1e-2)


def test_rates_start_from_the_batch_and_move_to_the_sequence():
    """A new sequence (no counts) gets the batch's rate; one with many of its own, its own."""
    glob, own = DraftCounts.empty(2), DraftCounts.empty(2)
    for _ in range(200):
        glob.add(2, 2, 2, decay=1.0)  # the batch: every draft kept
        own.add(2, 2, 0, decay=1.0)  # this sequence: every first token lost
    rates = shrunk_rates([None, own], glob, "kept", "tries", 0.5, prior=4.0)
    assert rates[0, 0] == pytest.approx(1.0, abs=0.03) and rates[1, 0] == pytest.approx(0.0, abs=0.03)
    assert np.all(rates >= 0) and np.all(rates <= 1)
