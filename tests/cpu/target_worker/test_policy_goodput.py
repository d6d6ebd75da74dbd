"""The speculation policy's model checked against measurement (`target_worker.policy_goodput`)."""

import numpy as np
import pytest

from outrider.target_worker.policy_config import PolicyConfig, PolicyStats
from outrider.target_worker.policy_goodput import GoodputCheck


def test_the_scale_is_measured_over_predicted_per_forward_size_and_fades():
    check = GoodputCheck(PolicyConfig(), PolicyStats())
    for r in range(20):
        check.timed(16, 12e-3, 10e-3, r)  # 16 tokens: 20% slower than predicted
        check.timed(64, 19e-3, 20e-3, r)
    assert check.scale(16, 20) == pytest.approx(1.2)
    assert check.scale(31, 20) == pytest.approx(1.2)  # the same octave
    assert check.scale(64, 20) == pytest.approx(0.95)
    assert check.scale(8, 20) == 1.0  # never measured at that size
    assert check.scale(16, 20 + 300) == 1.0  # not measured lately
    for r in range(21, 30):
        check.timed(1, 1.0, 1e-3, r)
    assert check.scale(1, 30) == 2.0  # (bounded)


def test_rounds_timed_at_once_leave_what_one_by_one_would():
    tokens = np.array([1.0, 1.0, 16.0, 17.0, 3.0, 1.0])
    measured, predicted = np.linspace(1e-3, 6e-3, 6), np.linspace(2e-3, 3e-3, 6)
    one, many = GoodputCheck(PolicyConfig(), PolicyStats()), GoodputCheck(PolicyConfig(), PolicyStats())
    for i, (n, m, p) in enumerate(zip(tokens, measured, predicted, strict=True)):
        one.timed(int(n), float(m), float(p), 10 + i)
    many.timed_rows(tokens, measured, predicted, 15)

    def at(check: GoodputCheck, rounds: int) -> dict:
        decay = check.config.goodput_decay
        return {k: [v * decay ** (rounds - kept[3]) for v in kept[:3]] for k, kept in check._timing.items()}

    assert one._timing.keys() == many._timing.keys() == {1, 2, 5}
    for key, values in at(one, 40).items():
        assert at(many, 40)[key] == pytest.approx(values)


def test_a_drafter_late_for_every_tree_vetoes_drafting_at_that_many_and_more():
    """Every tree of a round asked of 16 sequences missed the deadline: drafting for 16 (the
    same octave, 16-31) or more is vetoed `probe_every` rounds, for fewer it is not; a retry
    that misses again is vetoed twice as long; trees in time for as many lift the veto."""
    config = PolicyConfig(probe_every=8)
    check = GoodputCheck(config, PolicyStats())
    check.late(16, True, 100)
    assert check.vetoed(100, 16) and check.vetoed(107, 31) and check.vetoed(107, 64)
    assert not check.vetoed(100, 8) and not check.vetoed(100, 1)
    assert not check.vetoed(108, 16)  # the retry
    check.late(16, True, 108)
    assert check.vetoed(123, 16) and not check.vetoed(124, 16)
    check.late(4, True, 124)  # late for fewer: vetoed there, and so at 16 as long
    assert check.vetoed_until(4) == check.vetoed_until(16) == 124 + 8
    check.late(16, False, 130)  # trees in time for 16: neither size is vetoed any more
    assert not check.vetoed(130, 16) and not check.vetoed(130, 4)
    check.late(16, True, 140)  # and the next miss starts afresh
    assert check.vetoed_until(16) == 148


def test_off_probes_at_a_batch_size_wait_until_drafting_there_is_measured():
    """A wave of requests passes through every batch size on its way up and down: an off probe
    at each size's first round (where the check could not yet compare: too few drafting rounds
    there) cost a whole batch's drafts and taught the check nothing it used."""
    config = PolicyConfig()
    check = GoodputCheck(config, PolicyStats())
    rounds = 0

    def run(num_seqs: int, count: int) -> list[int]:  # the rounds that were off probes
        nonlocal rounds
        probes = []
        for _ in range(count):
            depths = check.checked([4] * num_seqs, False, rounds)
            probes += [rounds] if check.off_probe else []
            committed = num_seqs if check.off_probe else 3 * num_seqs  # drafting pays 3x
            check.record(committed, float(num_seqs), 0, num_seqs)
            assert any(depths) != check.off_probe
            rounds += 1
        return probes

    for size in (1, 2, 4, 8, 16, 32):  # the ramp: a few rounds at each size
        assert not run(size, 5)
    start, probes = rounds, run(64, 60)
    assert probes and probes[0] - start >= config.goodput_min_rounds and len(probes) >= 3
