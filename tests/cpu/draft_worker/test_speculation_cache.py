"""The speculation cache (draft_worker.speculation): a cached tree is exactly the tree propose()
builds from the same extended state (ngram, suffix, and draft_model, whose forks borrow the
sequence's KV extent); a delta nobody guessed is a counted miss; every fork is adopted or
released exactly once; acceptance rates come from the real deltas; a real round interrupts a
guess; and guesses that rarely come true (in time) are drafted only now and then.
"""

from __future__ import annotations

import pytest
import torch
from spec_testlib import CONFIGS, REPEAT, VOCAB, make_update, same_tree

from outrider.draft_worker import build_proposer
from outrider.draft_worker.ngram import NgramProposer
from outrider.draft_worker.proposer import parse_speculative_config
from outrider.draft_worker.speculation import AcceptanceModel, SpecCache, SpecCacheConfig


@pytest.fixture
def make_proposer(request):
    """method -> a fresh proposer; draft_model drafts with the tiny family's draft LM."""

    def make(method: str):
        if method == "draft_model":
            family = request.getfixturevalue("tiny_family")
            config = {"method": method, "model": str(family.draft_dir), "num_speculative_tokens": 4}
            return build_proposer(config, vocab_size=2048)
        return build_proposer(CONFIGS[method], vocab_size=VOCAB)

    return make


@pytest.mark.parametrize("method", [*sorted(CONFIGS), "draft_model"])
def test_a_cached_tree_is_the_tree_propose_builds(method, make_proposer):
    proposer = make_proposer(method)
    cache = SpecCache(proposer, SpecCacheConfig(max_outcomes=4))
    first = make_update(1, 1, REPEAT, reset=True)
    hints = cache.draft_hints()  # what the server's real rounds carry
    (tree,) = proposer.propose([first], hints)
    rows = proposer.runner.cache.free_rows if method == "draft_model" else None
    cache.schedule(first, tree)
    assert cache.has_work()
    cache.run_one()
    outcomes = cache.outcomes(first, tree)
    assert outcomes, "a repetitive context has a likely outcome"
    for outcome in outcomes:
        # A fresh proposer fed the same history and this delta drafts the same tree.
        fresh = make_proposer(method)
        fresh.propose([first], hints)  # the hints the cache gave its proposer
        (expected,) = fresh.propose([make_update(1, 2, list(outcome.delta))], hints)
        assert same_tree(cache.entries(1)[outcome.delta], expected)
    # A hit answers with that tree and adopts the extended state: the round after matches too.
    best = outcomes[0]
    hit = cache.lookup(make_update(1, 2, list(best.delta)))
    assert hit is not None and cache.stats.hits == 1 and cache.stats.saved_s > 0
    reference = make_proposer(method)
    reference.propose([first], hints)
    (expected,) = reference.propose([make_update(1, 2, list(best.delta))], hints)
    assert same_tree(hit, expected)
    later = make_update(1, 3, [int(hit.tokens[1]), 5])
    assert cache.draft_hints() == hints
    assert same_tree(proposer.propose([later], hints)[0], reference.propose([later], hints)[0])
    if rows is not None:  # forks borrowed the extent: speculating took no KV rows
        assert proposer.runner.cache.free_rows == rows


def test_a_delta_nobody_guessed_is_a_miss():
    proposer = build_proposer(CONFIGS["ngram"], vocab_size=VOCAB)
    cache = SpecCache(proposer, SpecCacheConfig())
    first = make_update(1, 1, REPEAT, reset=True)
    (tree,) = proposer.propose([first])
    cache.schedule(first, tree)
    cache.run_one()
    assert cache.lookup(make_update(1, 2, [42, 43])) is None
    assert (cache.stats.hits, cache.stats.misses) == (0, 1)
    # Resets and finished sequences are neither hits nor misses.
    assert cache.lookup(make_update(1, 3, REPEAT, reset=True)) is None
    assert cache.stats.misses == 1


class CountingNgram(NgramProposer):
    """ngram, recording what becomes of every fork it makes (held, so ids stay unique)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.forks, self.adopted, self.released = [], [], []

    def fork_state(self, state):
        fork = super().fork_state(state)
        self.forks.append(fork)
        return fork

    def adopt(self, seq_id, state) -> None:
        self.adopted.append(state)
        super().adopt(seq_id, state)

    def release_state(self, state) -> None:
        self.released.append(state)


def test_every_fork_is_adopted_or_released_exactly_once():
    """Misses, the other outcomes of a hit, outcome probes, resets and forgotten sequences all
    hand their forks to `release_state`, so a proposer whose forks hold memory never leaks."""
    proposer = CountingNgram(parse_speculative_config(CONFIGS["ngram"]), vocab_size=VOCAB)
    cache = SpecCache(proposer, SpecCacheConfig(max_outcomes=3, min_hit_rate=0.0))  # never gated
    gen = torch.Generator().manual_seed(0)
    updates = {s: make_update(s, 0, REPEAT, reset=True) for s in range(3)}
    trees = dict(zip(updates, proposer.propose(list(updates.values())), strict=True))
    for round in range(1, 30):
        for seq, update in updates.items():
            cache.schedule(update, trees[seq])
        while cache.has_work():
            cache.run_one()
        for seq in updates:
            outcomes = cache.outcomes(updates[seq], trees[seq]) if seq != 2 else []
            guess = round % 3 != 0 and outcomes
            delta = list(outcomes[0].delta) if guess else torch.randint(VOCAB, (2,), generator=gen).tolist()
            updates[seq] = make_update(seq, round, delta, reset=round % 7 == 0 and seq == 1)
            hit = cache.lookup(updates[seq])
            trees[seq] = hit if hit is not None else proposer.propose([updates[seq]])[0]
    for seq in updates:
        cache.forget(seq)
    assert cache.stats.hits > 5 and cache.stats.misses > 5
    fates = sorted(map(id, proposer.adopted + proposer.released))
    assert len(proposer.forks) > 100 and fates == sorted(map(id, proposer.forks))


def test_acceptance_rates_are_learned_from_the_real_deltas():
    """Each real delta shows how far the tree it answers was accepted: per-depth counts, with a
    0.7 prior, drive how outcomes are ranked."""
    proposer = build_proposer(CONFIGS["ngram"], vocab_size=VOCAB)
    cache = SpecCache(proposer, SpecCacheConfig())
    first = make_update(1, 1, REPEAT, reset=True)
    (tree,) = proposer.propose([first])
    assert tree.tokens[1:].tolist() == [11, 3, 7, 9] and cache.acceptance.rate(1) == pytest.approx(0.7)
    cache.schedule(first, tree)
    cache.lookup(make_update(1, 2, [11, 3, 5]))  # 11 and 3 accepted, 7 rejected: bonus 5
    rate = cache.acceptance.rate
    assert (rate(1), rate(2), rate(3)) == pytest.approx((2.4 / 3, 2.4 / 3, 1.4 / 3))
    model = cache.acceptance
    model.observe(tree, [8])  # rejected at depth 1
    model.observe(tree, [11, 3, 7, 9, 4])  # the whole chain: nothing rejected below the leaf
    assert (model.reached, model.accepted) == ([3, 2, 2, 1], [2, 2, 1, 1])
    # A model that has seen mostly full acceptance puts the full path first.
    for _ in range(20):
        model.observe(tree, [11, 3, 7, 9, 4])
    assert len(cache.outcomes(first, tree)[0].path) == 4


def test_a_real_round_interrupts_a_guess_mid_draft(make_proposer):
    """`interrupted()` turning True abandons the outcome at the draft model's next step: no entry,
    nothing pushed, and the sequence's own state drafts exactly as if nobody had speculated."""
    proposer = make_proposer("draft_model")
    cache = SpecCache(proposer, SpecCacheConfig(max_outcomes=2))
    first = make_update(1, 1, REPEAT, reset=True)
    hints = cache.draft_hints()
    (tree,) = proposer.propose([first], hints)
    rows = proposer.runner.cache.free_rows
    steps = []

    def interrupted() -> bool:  # a real round arrives after two draft steps of the first guess
        steps.append(1)
        return len(steps) > 2

    pushed = []
    cache.schedule(first, tree)
    cache.run_one(push=lambda *a: pushed.append(a), interrupted=interrupted)
    assert cache.stats.interrupted == 1 and len(steps) == 3
    assert not pushed and not cache.entries(1)
    assert proposer.runner.cache.free_rows == rows  # the scratch extent went back
    delta = make_update(1, 2, [int(tree.tokens[1]), 5])
    assert cache.lookup(delta) is None  # a miss: the real round drafts
    reference = make_proposer("draft_model")
    reference.propose([first], hints)
    # The interrupt was an argument of the guess: the real round drafts uninterrupted.
    assert same_tree(proposer.propose([delta], hints)[0], reference.propose([delta], hints)[0])


def run_rounds(cache, proposer, rounds: int, right_from: int, in_time: bool = True) -> list[bool]:
    """Real rounds of one sequence; from round `right_from` the first guess comes true (and the
    target says it answered from it, if `in_time`). Returns, per round, whether it was guessed."""
    update = make_update(1, 1, REPEAT, reset=True)
    (tree,) = proposer.propose([update], cache.draft_hints())
    scheduled = []
    for round in range(2, rounds):
        cache.schedule(update, tree)
        scheduled.append(cache.has_work())
        if cache.has_work():
            cache.run_one()
        guesses = list(cache.entries(1))
        hit = round >= right_from and bool(guesses)
        if hit:
            delta = list(guesses[0])
        else:  # a delta no guess assumed, of a token the context repeats (so the tree has nodes)
            delta = [next(t for t in (3, 7, 9, 11, 12) if (t,) not in guesses)]
        update = make_update(1, round, delta)
        update.answered = hit and in_time
        tree = cache.lookup(update) or proposer.propose([update], cache.draft_hints())[0]
        assert tree.num_nodes > 1
        assert cache.draft_hints().outcome_rows == (not cache.gated())  # no extra draft step while gated
    return scheduled


def test_guesses_that_come_late_keep_the_gate_closed_and_probes_thin_out():
    """Hits the target did not answer from (the pushed tree came after it asked) save the
    drafter's time only, which lanes already hide: the gate stays closed, and the probe
    rounds thin out (every 2nd, 4th, then 8th round at most)."""
    proposer = build_proposer(CONFIGS["ngram"], vocab_size=VOCAB)
    cache = SpecCache(proposer, SpecCacheConfig(min_hit_rate=0.25, probe_every=2, max_probe_every=8))
    scheduled = run_rounds(cache, proposer, 80, right_from=2, in_time=False)
    assert cache.stats.hits > 10 and cache.gated()
    probes = [i for i, s in enumerate(scheduled) if s][20:]  # the rounds guessed once gated
    assert [b - a for a, b in zip(probes, probes[1:], strict=False)][:4] == [4, 8, 8, 8]


def test_guesses_that_rarely_come_true_are_drafted_only_now_and_then():
    """Below min_hit_rate (of the rounds speculated for) one round in probe_every is speculated
    for, so the rate keeps being measured, and speculation resumes once guesses come true."""
    proposer = build_proposer(CONFIGS["ngram"], vocab_size=VOCAB)
    config = SpecCacheConfig(min_hit_rate=0.25, probe_every=4, max_probe_every=4)
    cache = SpecCache(proposer, config)
    scheduled = run_rounds(cache, proposer, 70, right_from=45)
    first_gated = scheduled.index(False)
    assert 15 <= first_gated <= 25  # about 20 tried rounds, all missed, before the gate closes
    gated = scheduled[first_gated:44]
    assert sum(gated) in (len(gated) // 4, len(gated) // 4 + 1)  # one probe round in four
    assert cache.stats.gated == scheduled.count(False)
    assert all(scheduled[-10:]) and not cache.gated()  # probes hit from round 45: the gate opened


def test_acceptance_is_also_counted_per_sequence():
    """One sequence the drafter always gets right and one it never does: each ranks its own
    outcomes by its own rates (pulled toward the global rate while its counts are few)."""
    proposer = build_proposer(CONFIGS["ngram"], vocab_size=VOCAB)
    (tree,) = proposer.propose([make_update(1, 1, REPEAT, reset=True)])  # chain 11 3 7 9
    model = AcceptanceModel()
    for _ in range(20):
        model.observe(tree, [11, 3, 7, 9, 4], seq_id=1)  # everything accepted
        model.observe(tree, [8], seq_id=2)  # rejected at depth 1
    overall = model.rate(1)
    assert model.rate(1, seq_id=1) > 0.9 > overall > 0.4 > 0.1 > model.rate(1, seq_id=2)
    assert model.rate(1, seq_id=3) == overall  # a sequence never seen: the global rate
    model.forget(1)
    assert model.rate(1, seq_id=1) == overall
