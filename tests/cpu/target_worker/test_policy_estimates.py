"""The speculation policy's estimators (`target_worker.policy_estimates`)."""

import numpy as np
import pytest

from outrider.target_worker.policy_estimates import (
    DraftCounts,
    expected_gains,
    shrunk_rates,
    spread_prior,
)


def test_goodput_rounds_recorded_at_once_as_one_by_one():
    from outrider.target_worker.policy_config import PolicyConfig, PolicyStats
    from outrider.target_worker.policy_goodput import GoodputCheck

    checks = [GoodputCheck(PolicyConfig(), PolicyStats()) for _ in range(2)]
    for check in checks:
        check.planned = False
        check.record(3, 2.5, 0, 4)
    committed, worth = np.array([1.0, 2.0, 1.0, 4.0]), np.array([1.1, 1.9, 0.8, 3.5])
    for c, w in zip(committed, worth, strict=True):
        checks[0].record(int(c), float(w), 0, 4)
    checks[1].record_rows(committed, worth, np.full(4, 4))
    assert checks[1].kinds[False] == pytest.approx(checks[0].kinds[False], rel=1e-12)
    assert checks[1].kinds[True] == [0.0, 0.0, 0.0]


def test_rates_start_from_the_batch_and_move_to_the_sequence():
    """A new sequence (no counts) gets the batch's rate; one with many of its own, its own."""
    glob, own = DraftCounts.empty(2), DraftCounts.empty(2)
    for _ in range(200):
        glob.add(2, 2, 2, decay=1.0)  # the batch: every draft kept
        own.add(2, 2, 0, decay=1.0)  # this sequence: every first token lost
    rates = shrunk_rates([None, own], glob, "kept", "tries", 0.5, prior=4.0)
    assert rates[0, 0] == pytest.approx(1.0, abs=0.03) and rates[1, 0] == pytest.approx(0.0, abs=0.03)
    assert np.all(rates >= 0) and np.all(rates <= 1)


def counts_keeping(
    rates: list[float], rounds: int = 30, seed: int = 0
) -> tuple[list[DraftCounts], DraftCounts]:
    """Depth-1 drafts, one a round, per sequence (keep chance `rates[i]`), decayed as a live
    sequence's are (0.8), and the batch-wide counts."""
    rng = np.random.default_rng(seed)
    own, glob = [DraftCounts.empty(1) for _ in rates], DraftCounts.empty(1)
    for _ in range(rounds):
        for counts, rate in zip(own, rates, strict=True):
            kept = int(rng.random() < rate)
            counts.add(1, 1, kept, 0.8)
            glob.add(1, 1, kept, 0.995)
    return own, glob


def test_the_keep_prior_follows_how_far_sequences_differ_beyond_their_noise():
    """Sequences keeping alike (their rates spread by their counts' noise alone) are weighed
    as the batch (the cap); sequences that differ keep the floor; too few to tell: None."""
    for seed in range(5):
        assert spread_prior(*counts_keeping([0.7] * 16, seed=seed), floor=4.0, cap=64.0) == 64.0
        assert spread_prior(*counts_keeping([0.95, 0.1] * 8, seed=seed), floor=4.0, cap=64.0) == 4.0
    assert spread_prior(*counts_keeping([0.7] * 3), floor=4.0, cap=64.0) is None
    fresh = [DraftCounts.empty(1) for _ in range(8)]  # no tries yet
    assert spread_prior(fresh, counts_keeping([0.7] * 4)[1], floor=4.0, cap=64.0) is None
    # Between: rates 0.25 and 0.75 (tau^2 = 1/16) are worth p(1 - p) / tau^2 - 1 = 3
    # pseudo-observations; the decayed counts (~5 tries, as noisy as ~9) overstate the noise,
    # so the estimate is larger: weighed toward the batch, never past what the spread shows.
    middle = spread_prior(*counts_keeping([0.25, 0.75] * 64, rounds=60), floor=1.0, cap=64.0)
    assert 3.0 <= middle <= 12.0


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


def test_dinkelbach_finds_the_best_deepest_budget_and_depths():
    """Against every (m, depths) enumerated: the batch's best committed tokens per second,
    with the drafter's wait set by m, each sequence within its own ceiling and m (from rate
    0: four iterations are enough)."""
    import itertools
    import random

    from outrider.target_worker.policy_estimates import dinkelbach

    rng = random.Random(0)
    for trial in range(200):
        batch, depth = rng.randint(1, 3), rng.randint(1, 4)
        rows, seconds = [], []
        for _ in range(batch):
            keep, tokens = rng.random(), [1.0]
            for _ in range(depth):
                tokens.append(tokens[-1] + keep ** len(tokens))
            rows.append((tokens, [1.0] * (depth + 1), [0.0] * (depth + 1)))
            step = rng.uniform(1e-4, 3e-3)
            seconds.append([2e-4] + [2e-4 + step * d for d in range(1, depth + 1)])
        ceiling = [rng.randint(0, depth) for _ in range(batch)]
        base, per_m = rng.uniform(1e-3, 5e-3), rng.uniform(0.0, 2e-3)
        wait = [0.0] + [rng.uniform(0.0, 1e-3) + per_m * m for m in range(1, depth + 1)]
        ms = list(range(depth + 1)) if trial % 2 else sorted({0, rng.randint(0, depth)})

        def rate(m, ks, rows=rows, seconds=seconds, base=base, wait=wait):
            return sum(r[0][k] for r, k in zip(rows, ks, strict=True)) / (
                base + wait[m] + sum(s[k] for s, k in zip(seconds, ks, strict=True))
            )

        best = max(
            rate(m, ks) for m in ms for ks in itertools.product(*(range(min(cap, m) + 1) for cap in ceiling))
        )
        solved = {m: dinkelbach(rows, seconds, ceiling, m, base + wait[m], 0.0) for m in ms}
        m = max(ms, key=lambda m: solved[m][0])  # as the policy picks among them
        lam, ks = solved[m]
        assert m in ms and all(k <= min(cap, m) for k, cap in zip(ks, ceiling, strict=True))
        assert rate(m, ks) == pytest.approx(best, rel=1e-6) and lam == pytest.approx(best, rel=1e-3)


def test_a_rounds_drafts_add_to_the_batch_wide_counts_as_one_by_one():
    """`add_round` weighs a round's drafts alike (its last's weight) and counts what `add`
    counts draft by draft: asked, drafted, tried and kept per depth."""
    from outrider.target_worker.policy_estimates import DraftCounts

    drafts = [(4, 4, 4), (4, 2, 1), (3, 0, 0), (2, 2, 0), (1, 1, 1), (4, 3, 3)]
    one_by_one, at_once = DraftCounts.empty(4), DraftCounts.empty(4)
    for draft in drafts:
        one_by_one.add(*draft, decay=1.0)
    at_once.add_round(drafts, decay=1.0)
    assert np.array(at_once.counts) == pytest.approx(np.array(one_by_one.counts))
    assert one_by_one.counts[0] == [6.0, 4.0, 3.0, 2.0]  # asked: a depth past the tree's + 1 is not
    # Decayed: the round as a whole weighs what its drafts did one by one, within the decay.
    for decay in (0.99, 0.9):
        one_by_one, at_once = DraftCounts.empty(4), DraftCounts.empty(4)
        for _ in range(3):
            for draft in drafts:
                one_by_one.add(*draft, decay=decay)
            at_once.add_round(drafts, decay=decay)
        older = decay ** (len(drafts) - 1)  # the round's first draft weighed this much less
        got, want = np.array(at_once.counts), np.array(one_by_one.counts)
        assert (want * (1 - 1e-12) <= got).all() and (got <= want / older * (1 + 1e-12)).all()
    empty = DraftCounts.empty(4)
    empty.add_round([], decay=0.9)
    assert empty.counts == [[0.0] * 4] * 4


def test_the_goodput_check_compares_drafting_with_rounds_without_drafts_at_the_same_batch_size():
    """The verify fit prices plain rounds well at batch 16 and 2x too high at batch 2 (rounds
    without drafts there read 0.5 committed per plain-equivalent token). At batch 16 drafting
    reads 1.0 and rounds without drafts 1.2: drafting loses there, and is vetoed at 16 (not at
    2, where nothing drafted). Pooled across sizes, the batch-2 rounds would have hidden it."""
    from outrider.target_worker.policy_config import PolicyConfig, PolicyStats
    from outrider.target_worker.policy_goodput import GoodputCheck

    config = PolicyConfig()
    check = GoodputCheck(config, PolicyStats())
    for planned, committed, worth, seqs, rounds in (
        (False, 2, 4.0, 2, 40),  # the ramp-down, mispriced by the fit
        (False, 16, 16 / 1.2, 16, 5),
        (True, 24, 24.0, 16, 20),
    ):
        check.planned = planned
        for _ in range(rounds):
            check.record(committed, worth, 0, seqs)
    on, off2, off16 = (
        check.select(16).kinds[True],
        check.select(2).kinds[False],
        check.select(16).kinds[False],
    )
    pooled_off = [a + b for a, b in zip(off2, off16, strict=True)]
    assert on[0] * pooled_off[1] >= on[1] * pooled_off[0]  # pooled: drafting "wins"
    assert check.vetoed(100, 16) and check.vetoed_until(16) > 100
    assert not check.vetoed(100, 2) and check.vetoed_until(2) == 0
