"""The speculation cache (draft_worker.spec_cache): a cached tree is exactly the tree propose()
builds from the same extended state (ngram, suffix, and draft_model, whose forks borrow the
sequence's KV extent); a delta nobody guessed is a counted miss; every fork is adopted or
released exactly once; and through a real server, client and engine, greedy output with the
cache on equals speculation off while a repetitive prompt scores hits.
"""

from __future__ import annotations

import time

import pytest
import torch

from outrider.draft_worker import build_proposer
from outrider.draft_worker.ngram import NgramProposer
from outrider.draft_worker.proposer import parse_speculative_config
from outrider.draft_worker.server import DraftIdentity, serve
from outrider.draft_worker.server_cli import build_server_proposer
from outrider.draft_worker.spec_cache import SpecCache, SpecCacheConfig
from outrider.proto import Limits, SamplingParams, SequenceUpdate, TreeBudget
from outrider.target_worker.draft_client import (
    DraftClientConfig,
    RemoteDraftSource,
    target_handshake,
    tokenizer_fingerprint,
)
from outrider.target_worker.engine import Engine
from outrider.target_worker.runner import ModelRunner
from outrider.target_worker.sequence import RequestParams

VOCAB = 50
BUDGET = TreeBudget(max_nodes=8, max_depth=4, top_k=2)
CONFIGS = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3},
    "suffix": {"method": "suffix", "num_speculative_tokens": 4},
}
REPEAT = [3, 7, 9, 11, 3, 7, 9, 12, 3, 7, 9, 11, 3, 7, 9]


def make_update(seq_id: int, round: int, tokens: list[int], reset: bool = False) -> SequenceUpdate:
    return SequenceUpdate(
        seq_id, round, torch.tensor(tokens, dtype=torch.int64), SamplingParams(), BUDGET, reset=reset
    )


def same_tree(a, b) -> bool:
    return (
        all(
            torch.equal(getattr(a, f), getattr(b, f)) for f in ("tokens", "parents", "q_nodes", "q_token_ids")
        )
        and torch.allclose(a.q_probs, b.q_probs)
        and (a.seq_id, a.round, a.sampling) == (b.seq_id, b.round, b.sampling)
    )


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
    (tree,) = proposer.propose([first])
    rows = proposer.runner.cache.free_rows if method == "draft_model" else None
    cache.schedule(first, tree)
    assert cache.has_work()
    cache.run_one()
    outcomes = cache.outcomes(first, tree)
    assert outcomes, "a repetitive context has a likely outcome"
    for outcome in outcomes:
        # A fresh proposer fed the same history and this delta drafts the same tree.
        fresh = make_proposer(method)
        fresh.outcome_rows = proposer.outcome_rows  # the cache asked its proposer for them
        fresh.propose([first])
        (expected,) = fresh.propose([make_update(1, 2, list(outcome.delta))])
        entry = cache._entries[1][outcome.delta]
        assert same_tree(entry.tree, expected)
    # A hit answers with that tree and adopts the extended state: the round after matches too.
    best = outcomes[0]
    hit = cache.lookup(make_update(1, 2, list(best.delta)))
    assert hit is not None and cache.stats.hits == 1 and cache.stats.saved_s > 0
    reference = make_proposer(method)
    reference.outcome_rows = proposer.outcome_rows
    reference.propose([first])
    (expected,) = reference.propose([make_update(1, 2, list(best.delta))])
    assert same_tree(hit, expected)
    later = make_update(1, 3, [int(hit.tokens[1]), 5])
    assert same_tree(proposer.propose([later])[0], reference.propose([later])[0])
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


# ---- through a real server, client and engine ----------------------------------------------

PROMPTS = [
    "    if value is None:\n        return None\n    if value is None:\n        return None\n    if value",
    "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):\n",
    "import os\nimport sys\nimport re\n\n\nclass Error(Exception):\n    pass\n\n\nclass",
    "        self.name = name\n        self.value = value\n        self.",
]


@pytest.fixture(scope="module")
def runner(tiny_family):
    return ModelRunner.from_pretrained(tiny_family.target_dir, max_model_len=512, kv_cache_rows=8 * 512)


@pytest.fixture(scope="module")
def prompts(tiny_family):
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tiny_family.tokenizer_dir / "tokenizer.json"))
    return [tokenizer.encode(text).ids for text in PROMPTS]


def generate(runner, prompts, source=None):
    # One lane: the drafter idles while the whole batch verifies, the window the cache fills
    # (with two lanes it drafts one lane while the other verifies and rarely has idle time).
    engine = Engine(
        runner, source, eos_token_id=None, max_batch=16, tree_budget=BUDGET, draft_timeout_s=None, lanes=1
    )
    completions = engine.generate(prompts, RequestParams(max_tokens=32, ignore_eos=True))
    return [c.token_ids for c in completions]


def connect(family, port: int) -> RemoteDraftSource:
    limits = Limits(max_batch=64, max_nodes=16, max_depth=8, max_top_k=4)
    request = target_handshake(
        family.target_dir, family.tokenizer_dir, model_id="demo-tiny-target", limits=limits
    )
    config = DraftClientConfig(round_deadline_s=5.0, backoff_initial_s=0.02, backoff_max_s=0.2)
    return RemoteDraftSource([f"127.0.0.1:{port}"], request, config)


def wait_until(condition, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()


@pytest.mark.parametrize("method", [*sorted(CONFIGS), "draft_model"])
def test_greedy_output_with_the_cache_equals_speculation_off(tiny_family, runner, prompts, method):
    plain = generate(runner, prompts)
    results = {}
    for cache in (SpecCacheConfig(min_hit_rate=0.0), None):  # never gated: every round is guessed
        proposer = build_server_proposer(
            method, {"num_speculative_tokens": 4}, tiny_family.draft_dir, tiny_family.tokenizer_dir
        )
        identity = DraftIdentity(
            f"test-{method}", proposer.vocab_size, tokenizer_fingerprint(tiny_family.tokenizer_dir)
        )
        server = serve(proposer, identity, address="127.0.0.1:0", speculation_cache=cache)
        source = connect(tiny_family, server.port)
        collect = source.collect

        def slow_collect(seq_ids, timeout_s=None, collect=collect):
            # A verify as slow as a real target's: the tiny one's is shorter than a draft_model
            # guess, which a real round would then interrupt every time (no hits to check).
            time.sleep(0.01)
            return collect(seq_ids, timeout_s)

        source.collect = slow_collect
        try:
            assert source.wait_ready(10)
            assert generate(runner, prompts, source) == plain
            if method == "draft_model":  # every sequence finished: every draft KV row is free again
                assert wait_until(lambda p=proposer: p.num_sequences == 0)
                assert proposer.runner.cache.free_rows == proposer.runner.cache.total_rows
            counters = source.counters
            results[cache is not None] = (server.stats, counters.trees_pushed_used)
            if cache is not None and method == "ngram":
                # Guesses drafted in microseconds reach the target long before its next round:
                # the engine had those trees without asking. (A slower drafter's guesses may
                # come after the real round, which is then answered as usual.)
                assert counters.trees_pushed_used > 0
            assert counters.trees_invalid == counters.trees_late == 0
        finally:
            source.close()
            server.stop(1)
    (on, pushed_used), (off, _) = results[True], results[False]
    assert on.spec_cache_hits > 0, on
    assert on.spec_cache_saved_s > 0 and on.spec_drafting_s > 0
    assert (off.spec_cache_hits, off.spec_cache_misses) == (0, 0)
    assert on.spec_cache_hits + on.spec_cache_misses <= off.trees_sent
    # Rounds the engine answered from a pushed guess got no copy from the worker (a guess the
    # worker had dropped, after a shared-state change, is drafted and sent as usual).
    assert on.trees_sent <= off.trees_sent <= on.trees_sent + pushed_used


def test_the_server_keeps_hitting_round_after_round_on_a_predictable_sequence():
    """A hit's round is speculated on too: when every guess comes true, every round after the
    first is answered from the cache (before, hits could only alternate with misses)."""
    from outrider.draft_worker.server import DraftBatcher

    proposer = build_proposer(CONFIGS["ngram"], vocab_size=VOCAB)
    limits = Limits(max_batch=8, max_nodes=8, max_depth=4, max_top_k=2)
    batcher = DraftBatcher(proposer, DraftIdentity("ngram", VOCAB, "fp"), limits, SpecCacheConfig())
    stream = batcher.open_stream()
    pattern = [3, 7, 9, 11] * 40
    sent, rounds = 12, 8
    try:
        from outrider.proto import DraftRequest

        for round in range(1, rounds + 1):
            new = pattern[:sent] if round == 1 else pattern[sent - 5 : sent]  # 4 accepted + a bonus
            update = make_update(1, round, new, reset=round == 1)
            batcher.submit(stream, DraftRequest([update]).to_proto())
            while not (message := stream.outbox.get(timeout=10)).trees:
                # The trees pre-drafted for this round were pushed ahead of it; one assumed this delta.
                assert any(list(p.new_tokens) == new for p in message.speculative)
            (tree,) = message.trees
            assert list(tree.tokens[1:5]) == pattern[sent : sent + 4]  # the whole chain is right
            sent += 5
            deadline = time.monotonic() + 10  # let the idle drafter pre-draft the next round
            while batcher.spec_cache.has_work():
                assert time.monotonic() < deadline
                time.sleep(0.01)
            time.sleep(0.05)  # the target's verify: the idle window the server learns to fill
        assert batcher.stats.spec_cache_hits == rounds - 1
        assert batcher.stats.trees_pushed >= rounds - 1
    finally:
        batcher.stop()


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


def test_speculation_runs_only_while_some_of_the_idle_window_is_left():
    """A guess starts while the drafter's usual idle time between real rounds is not used up;
    one that overruns is interrupted at a draft step, so the count is rounded up."""
    from outrider.draft_worker.server import DraftBatcher

    proposer = build_proposer(CONFIGS["ngram"], vocab_size=VOCAB)
    limits = Limits(max_batch=8, max_nodes=8, max_depth=4, max_top_k=2)
    batcher = DraftBatcher(
        proposer, DraftIdentity("ngram", VOCAB, "fp"), limits, SpecCacheConfig(max_outcomes=4)
    )
    batcher.stop()  # its thread is gone: the scheduling decisions are called directly below
    cache = batcher.spec_cache
    first = make_update(1, 1, REPEAT, reset=True)
    cache.schedule(first, proposer.propose([first])[0])
    assert batcher._idle_work()  # nothing measured yet: try
    batcher._window_s = 0.010  # rounds come every ~10 ms
    batcher._idle_since = time.perf_counter() - 0.015  # idle for 15 ms: the next round is due
    cache.outcome_cost_s = 0.002
    assert not batcher._idle_work()
    batcher._idle_since = time.perf_counter()
    assert batcher._outcomes_that_fit() == 4  # at most max_outcomes
    cache.outcome_cost_s = 0.003
    assert batcher._outcomes_that_fit() == 4  # ceil(10 / 3)
    cache.outcome_cost_s = 0.020  # longer than the window: one starts, and may be interrupted
    assert batcher._outcomes_that_fit() == 1


def test_a_real_round_interrupts_a_guess_mid_draft(make_proposer):
    """`interrupted()` turning True abandons the outcome at the draft model's next step: no entry,
    nothing pushed, and the sequence's own state drafts exactly as if nobody had speculated."""
    proposer = make_proposer("draft_model")
    cache = SpecCache(proposer, SpecCacheConfig(max_outcomes=2))
    first = make_update(1, 1, REPEAT, reset=True)
    (tree,) = proposer.propose([first])
    rows = proposer.runner.cache.free_rows
    steps = []

    def interrupted() -> bool:  # a real round arrives after two draft steps of the first guess
        steps.append(1)
        return len(steps) > 2

    pushed = []
    cache.schedule(first, tree)
    cache.run_one(push=lambda *a: pushed.append(a), interrupted=interrupted)
    assert cache.stats.interrupted == 1 and len(steps) == 3
    assert not pushed and not cache._entries[1]
    assert proposer.interrupted is None  # only set while speculating
    assert proposer.runner.cache.free_rows == rows  # the scratch extent went back
    delta = make_update(1, 2, [int(tree.tokens[1]), 5])
    assert cache.lookup(delta) is None  # a miss: the real round drafts
    reference = make_proposer("draft_model")
    reference.outcome_rows = proposer.outcome_rows
    reference.propose([first])
    assert same_tree(proposer.propose([delta])[0], reference.propose([delta])[0])


def run_rounds(cache, proposer, rounds: int, right_from: int, in_time: bool = True) -> list[bool]:
    """Real rounds of one sequence; from round `right_from` the first guess comes true (and the
    target says it answered from it, if `in_time`). Returns, per round, whether it was guessed."""
    update = make_update(1, 1, REPEAT, reset=True)
    (tree,) = proposer.propose([update])
    scheduled = []
    for round in range(2, rounds):
        cache.schedule(update, tree)
        scheduled.append(cache.has_work())
        if cache.has_work():
            cache.run_one()
        guesses = list(cache._entries.get(1, {}))
        hit = round >= right_from and bool(guesses)
        if hit:
            delta = list(guesses[0])
        else:  # a delta no guess assumed, of a token the context repeats (so the tree has nodes)
            delta = [next(t for t in (3, 7, 9, 11, 12) if (t,) not in guesses)]
        update = make_update(1, round, delta)
        update.answered = hit and in_time
        tree = cache.lookup(update) or proposer.propose([update])[0]
        assert tree.num_nodes > 1
        assert proposer.outcome_rows == (not cache.gated())  # no extra draft step while gated
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


def test_a_round_the_target_answered_from_a_pushed_guess_gets_no_duplicate():
    from outrider.draft_worker.server import DraftBatcher
    from outrider.proto import DraftRequest

    proposer = build_proposer(CONFIGS["ngram"], vocab_size=VOCAB)
    limits = Limits(max_batch=8, max_nodes=8, max_depth=4, max_top_k=2)
    batcher = DraftBatcher(proposer, DraftIdentity("ngram", VOCAB, "fp"), limits, SpecCacheConfig())
    stream = batcher.open_stream()
    pattern = [3, 7, 9, 11] * 10
    try:
        batcher.submit(stream, DraftRequest([make_update(1, 1, pattern[:12], reset=True)]).to_proto())
        guesses = {}
        while len(guesses) < 1 or batcher.spec_cache.has_work():  # the tree, then the guesses
            message = stream.outbox.get(timeout=10)
            guesses.update({tuple(p.new_tokens): p for p in message.speculative})
        delta = list(next(iter(guesses)))
        answered = make_update(1, 2, delta)
        answered.answered = True  # the target used the guess
        batcher.submit(stream, DraftRequest([answered]).to_proto())
        deadline = time.monotonic() + 10
        while batcher.stats.spec_cache_hits < 1:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        time.sleep(0.1)
        while not stream.outbox.empty():
            assert not stream.outbox.get().trees  # only guesses for round 3, no copy of round 2's
        assert batcher.stats.trees_sent == 1
    finally:
        batcher.stop()


def test_acceptance_is_also_counted_per_sequence():
    """One sequence the drafter always gets right and one it never does: each ranks its own
    outcomes by its own rates (pulled toward the global rate while its counts are few)."""
    from outrider.draft_worker.spec_cache import AcceptanceModel

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
