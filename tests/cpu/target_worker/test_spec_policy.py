"""The speculation policy (`target_worker.spec_policy`) on synthetic rounds.

A simulated engine: verify costs a + b * tokens seconds, drafting c + e * depth, and each
sequence keeps a draft token at depth d with its own probability. The policy must draft deep
where drafts are cheap and kept, not at all where they are not, per sequence, and keep
probing the sequences it turned off.
"""

import random

import pytest

from outrider.proto import TreeBudget
from outrider.target_worker import policy_quiet
from outrider.target_worker.policy_estimates import sequence_seconds
from outrider.target_worker.spec_policy import PolicyConfig, SpeculationPolicy

CEILING = TreeBudget(max_nodes=9, max_depth=8, top_k=1)


def drafted(rng, keep, ids, depths) -> list[tuple[int, int, int, int, int]]:
    """Each sequence's outcome of a chain as deep as its depth, each token kept with chance
    `keep[seq_id]` while those above it were: (seq_id, budget, depth, kept, committed)."""
    outcomes = []
    for seq_id, k in zip(ids, depths, strict=True):
        kept = 0
        while kept < k and rng.random() < keep[seq_id]:
            kept += 1
        outcomes.append((seq_id, k, k, kept, kept + 1))
    return outcomes


def simulate(
    policy, accept: dict[int, float], rounds: int, verify=(1e-3, 5e-5, 1e-4), draft=(2e-4, 1e-4), seed=0
):
    """Runs `rounds` rounds of every sequence in `accept` (seq_id -> per-token acceptance);
    a round costs verify[0] + verify[1] * tokens + verify[2] * drafting sequences, plus
    draft[0] + draft[1] * deepest depth when any drafts. Returns the last round's depths."""
    rng = random.Random(seed)
    ids = list(accept)
    depths = [CEILING.max_depth] * len(ids)
    for _ in range(rounds):
        outcomes, tokens = drafted(rng, accept, ids, depths), sum(k + 1 for k in depths)
        deepest, drafting = max(depths), sum(k > 0 for k in depths)
        round_s = verify[0] + verify[1] * tokens + verify[2] * drafting
        draft_s = draft[0] + draft[1] * deepest if deepest else 0.0
        policy.observe(outcomes, tokens, round_s, deepest, draft_s)
        depths = [b.max_depth for b in policy.budgets(ids, [CEILING] * len(ids), 0)]
    return dict(zip(ids, depths, strict=True))


def test_cheap_drafts_that_are_kept_run_deep():
    chosen = simulate(SpeculationPolicy(CEILING), {0: 0.9, 1: 0.9}, rounds=60)
    assert min(chosen.values()) >= 5


def test_a_cost_per_sequence_is_a_fixed_cost_of_the_round():
    """u B (each sequence's cost whatever it drafts: a served replica streaming its chunk)
    makes a round dearer whatever the depths, so more tokens a round pay where, priced per
    token instead, they would not: the same batch drafts with it and not without."""

    def depths(u: float) -> list[int]:
        policy = SpeculationPolicy(CEILING)
        simulate(policy, {i: 0.6 for i in range(4)}, rounds=60)
        coefficients = (1e-3, 1e-3, 1e-4, 1e-4, u, 0.0)  # a, b, r, s, u, j
        policy.verify_cost.solve = policy.verify_cost.coefficients = lambda: coefficients
        policy._next_solve = policy.rounds  # a full solve
        return policy._depths(policy._gain(range(4)), [CEILING.max_depth] * 4, 0)

    assert sum(depths(0.0)) == 0
    assert min(depths(5e-3)) >= 1


def test_a_lone_sequences_step_is_paid_once_whatever_its_depth():
    """j (a lone sequence's forward steps from a matrix-vector to a matrix product once it
    carries drafts) is paid by any depth alike: a lone sequence that drafts at all goes
    deeper with it than where the same seconds were spread over its tokens, and at batch 2
    (a matrix product either way) it plays no part."""

    def depths(j: float, batch: int = 1) -> list[int]:
        policy = SpeculationPolicy(CEILING)
        simulate(policy, {i: 0.8 for i in range(batch)}, rounds=60)
        coefficients = (1e-3, 4e-4, 1e-4, 1e-4, 0.0, j)  # a, b, r, s, u, j
        policy.verify_cost.solve = policy.verify_cost.coefficients = lambda: coefficients
        policy.draft_cost.solve = policy.draft_cost.coefficients = lambda: (1e-5, 0.0, 0.0, 0.0)
        policy._next_solve = policy.rounds  # a full solve
        return policy._depths(policy._gain(range(batch)), [CEILING.max_depth] * batch, 0)

    (shallow,), (deep,) = depths(0.0), depths(1e-3)
    assert 1 <= shallow < deep
    assert depths(0.0, batch=2) == depths(1e-3, batch=2)


def test_costly_drafts_that_are_lost_are_turned_off():
    # Verify cost grows steeply with tokens (a compute-bound CPU) and drafting is expensive.
    policy = SpeculationPolicy(CEILING)
    chosen = simulate(policy, {0: 0.05, 1: 0.05}, rounds=60, verify=(1e-3, 1e-3, 1e-4), draft=(5e-4, 1e-3))
    assert set(chosen.values()) <= {0, 1}  # 1 only as a probe
    assert policy.stats.rounds_off > 0


def test_a_batch_of_a_size_the_draft_cost_fit_has_not_seen_is_probed_at_once():
    """At batch 1 a draft step's cost and a draft token's are one term (one sequence asked:
    K = m), so what the fit says of 16 sequences' drafts is a guess. Off at batch 1, a policy
    whose first batch of 16 arrives probes it at once, however far its next probe was set by
    batch-1 probes, and once: then the fit has rows of that size."""
    policy = SpeculationPolicy(CEILING)
    simulate(policy, {0: 0.05}, rounds=60, verify=(1e-3, 1e-3, 1e-4), draft=(5e-4, 1e-3))
    assert policy._solved[0] == 0 and policy._next_probe > policy.rounds + 1
    ids = list(range(16))
    assert not policy.quiet(16)
    depths = [b.max_depth for b in policy.budgets(ids, [CEILING] * 16, 0)]
    assert all(depths)  # every sequence probes
    outcomes = [(s, k, k, 0, 1) for s, k in zip(ids, depths, strict=True)]
    policy.observe(outcomes, 16 + sum(depths), 8e-3, max(depths), 5e-3)
    assert not any(b.max_depth for b in policy.budgets(ids, [CEILING] * 16, 0))


def test_rounds_measured_slower_than_the_fits_say_are_priced_as_measured():
    """The solver's rate of each option is divided by how much longer rounds forwarding about
    as many tokens measured than the fits predicted (`GoodputCheck.scale`): the fits give not
    drafting (4 tokens) ~4% over drafting 2 a sequence (12); where rounds of 4 tokens run 20%
    over their prediction and rounds of 8-15 as predicted, drafting wins; where rounds of 8-15
    were not measured lately, they are taken as far over as rounds without drafts (the first
    rounds of a wave of requests streaming their first tokens ran ~1.6x the fits without
    drafts, and against drafting sizes at 1 that turned drafting on where it lost)."""

    def depths(off_scale: float, drafting_measured: bool = True) -> list[int]:
        policy = SpeculationPolicy(CEILING)
        simulate(policy, {i: 0.6 for i in range(4)}, rounds=60)
        coefficients = (2e-3, 2e-4, 1e-4, 1e-4, 0.0, 0.0)  # a, b, r, s, u, j
        policy.verify_cost.solve = policy.verify_cost.coefficients = lambda: coefficients
        policy.check._timing.clear()
        for r in range(policy.rounds - 20, policy.rounds):
            policy.check.timed(4, off_scale * 3e-3, 3e-3, r)
            if drafting_measured:
                policy.check.timed(12, 6e-3, 6e-3, r)
        policy._next_solve = policy.rounds  # a full solve
        return policy._depths(policy._gain(range(4)), [CEILING.max_depth] * 4, 0)

    assert sum(depths(1.0)) == 0
    assert depths(1.2) == [2, 2, 2, 2]
    assert sum(depths(1.2, drafting_measured=False)) == 0
    assert sum(depths(1.6, drafting_measured=False)) == 0


def test_at_batch_1_the_fits_are_not_scaled():
    """A lone sequence's forward shape is the fits' own (the lone step j): measured rounds of
    one token far under their prediction do not turn a lone sequence's drafts off."""
    policy = SpeculationPolicy(CEILING)  # drafting ~1.2x not drafting, by the fits
    simulate(policy, {0: 0.7}, rounds=80, verify=(1e-3, 2e-4, 1e-4), draft=(2e-4, 1e-4))
    assert not policy.check._timing  # (batch-1 rounds are not timed: `_timed`)
    for r in range(policy.rounds - 20, policy.rounds):
        policy.check.timed(1, 0.5e-3, 1e-3, r)  # (at B > 1: rounds without drafts twice as fast)
    policy._next_solve = policy.rounds  # a full solve
    assert policy._depths(policy._gain([0]), [CEILING.max_depth], 0)[0] > 0


def test_each_sequence_gets_its_own_depth():
    chosen = simulate(SpeculationPolicy(CEILING), {0: 0.95, 1: 0.02}, rounds=80, verify=(1e-3, 4e-4, 1e-4))
    assert chosen[0] >= 3 and chosen[1] <= 1


def depth_spreads(policy, keep: list[float], rounds: int = 300, seed: int = 0) -> list[int]:
    """Rounds of one batch (per-token keep chance per sequence; a cheap verify, so depth 2-3
    is best); the spread (deepest - shallowest) of each round's depths after the first 100."""
    rng, ids, spreads = random.Random(seed), list(range(len(keep))), []
    depths = [CEILING.max_depth] * len(ids)
    for r in range(rounds):
        outcomes = drafted(rng, keep, ids, depths)
        tokens = sum(k + 1 for k in depths)
        round_s = 2e-3 + 5e-5 * tokens + 2e-5 * sum(k > 0 for k in depths)
        policy.observe(outcomes, tokens, round_s, max(depths), 1e-4 if max(depths) else 0.0)
        depths = [b.max_depth for b in policy.budgets(ids, [CEILING] * len(ids), 0)]
        spreads += [max(depths) - min(depths)] if r >= 100 else []
    return spreads


def test_sequences_that_keep_alike_draft_alike():
    """16 sequences with one keep chance (0.7): their own counts differ by noise alone, and
    weighed against the batch's by that (`spread_prior`) they get one depth, give or take one.
    With the prior's fixed 4 pseudo-observations a few misses sent one to depth 1 and a lucky
    one to 5 (most rounds spread by 2-7): tokens(k) is concave, so the mix kept fewer tokens
    for the same nodes (replay a = 0.7, batch 16: 0.91x plain, 0.97x with the spread)."""
    for seed in range(3):
        policy = SpeculationPolicy(CEILING)
        spreads = depth_spreads(policy, [0.7] * 16, seed=seed)
        assert sum(s >= 2 for s in spreads) <= 0.1 * len(spreads)
        assert policy._keep_prior[True] == 16 * policy.config.prior_strength
    # Sequences that differ keep their own depths.
    policy = SpeculationPolicy(CEILING)
    spreads = depth_spreads(policy, [0.95, 0.1] * 8)
    assert policy._keep_prior[True] == policy.config.prior_strength
    assert sum(s >= 4 for s in spreads) >= 0.9 * len(spreads)


def lookup_rounds(policy, proposes: float, keeps: float, rounds: int, seed: int = 0) -> list[int]:
    """A lookup drafter (ngram-like): asked for k tokens, it drafts all k with probability
    `proposes` and nothing otherwise; a drafted token is kept with probability `keeps`. Verify
    costs 1 ms + 1 ms a token (compute-bound), drafting nothing. Returns the budgets given."""
    rng = random.Random(seed)
    given, k = [], CEILING.max_depth
    for _ in range(rounds):
        drafted = k if rng.random() < proposes else 0
        kept = 0
        while kept < drafted and rng.random() < keeps:
            kept += 1
        policy.observe([(0, k, drafted, kept, kept + 1)], 1 + drafted, 1e-3 * (2 + drafted), k, 0.0)
        k = policy.budgets([0], [CEILING], 0)[0].max_depth
        given.append(k)
    return given


def test_asking_a_drafter_that_mostly_proposes_nothing_is_priced_by_what_it_drafts():
    """A lookup that matches one round in five but is then kept: asking costs only the tokens
    it drafts, so the policy keeps asking at depth, as fixed K would (counting an empty
    proposal as a lost first token and the budget's nodes as the cost turned this off)."""
    given = lookup_rounds(SpeculationPolicy(CEILING), proposes=0.2, keeps=0.97, rounds=400)
    assert sum(k >= 4 for k in given[200:]) >= 180
    # The same match rate with drafts that are lost: not worth asking (but for depth-1 probes,
    # frequent here since they cost next to nothing).
    given = lookup_rounds(SpeculationPolicy(CEILING), proposes=0.2, keeps=0.05, rounds=400)
    assert sum(k <= 1 for k in given[200:]) >= 195


def test_a_sequence_decoding_for_the_first_time_is_decided_for_at_once_while_off():
    """Off everywhere, in a calm stretch, a new request's sequence (`quiet(..., arrived=True)`)
    makes a solve due at once, at most every `resolve_every` rounds: known only by its class's
    batch-wide counts, it may pay where the last solve's sequences did not (unseen, a new
    request at batch 1 waited for the next probe)."""
    policy = SpeculationPolicy(CEILING)
    lookup_rounds(policy, proposes=0.2, keeps=0.0, rounds=200)  # lost drafts: off
    assert policy._solved[0] == 0
    policy._next_probe = policy._next_solve = policy.rounds + 500  # nothing due for long
    quiet = []
    for _ in range(3):
        quiet.append(policy.quiet(1))
        policy.observe_quiet(1, 0, 2e-3)
    assert quiet[1:] == [True, True]
    assert not policy.quiet(1, arrived=True) and policy._due()
    policy.budgets([1000], [CEILING], 0)  # the solve
    assert not policy._due()
    policy.observe([(1000, 0, 0, 0, 1)], 1, 2e-3, 0, 0.0)
    policy.quiet(1, arrived=True)  # another, within `resolve_every` rounds: no solve
    assert not policy._due()
    # While drafting (not off everywhere) an arrival changes nothing here.
    drafting = SpeculationPolicy(CEILING)
    lookup_rounds(drafting, proposes=1.0, keeps=0.97, rounds=200)
    assert drafting._solved[0] > 0
    due = drafting._next_solve
    drafting.quiet(1, arrived=True)
    assert drafting._next_solve == due


def test_a_probe_the_drafter_had_nothing_for_brings_the_next_one_in():
    """A lookup with no match (prose) answers a probe with nothing: no evidence of what drafts
    are worth, so the next probe comes `probe_every` rounds on at most, then 2x, up to 4x
    while they come back empty, however far the cost alone had set it (the policy stayed off
    through later loops); a probe that keeps a draft starts the spacing over."""
    policy = SpeculationPolicy(CEILING)
    lookup_rounds(policy, proposes=0.2, keeps=0.0, rounds=200)  # lost drafts: off
    every, probes, k, match = policy.config.probe_every, [], 0, False
    for _ in range(600):
        drafted = k if match else 0
        policy.observe([(0, k, drafted, drafted, drafted + 1)], 1 + drafted, 1e-3 * (2 + drafted), k, 0.0)
        k = policy.budgets([0], [CEILING], 0)[0].max_depth
        if k and policy._solved[0] == 0:  # a probe: spaced as by its cost alone, far off
            probes.append(policy.rounds)
            policy._next_probe = policy.rounds + 500
            match = len(probes) == 5  # the fifth probe finds a match, kept whole
    gaps = [b - a for a, b in zip(probes, probes[1:], strict=False)]
    assert max(gaps[:4]) <= 4 * every + 1 and gaps[4] <= 2  # (a kept probe: the next at once)
    fresh, spacing = SpeculationPolicy(CEILING), []
    for _ in range(4):  # empty probes in a row: 1x, 2x, 4x, 4x `probe_every`
        fresh._next_probe = fresh.rounds + 500
        fresh._note_probes([(0, 2, 0, 0, 1)], 1, 1.0, 0)
        spacing.append(fresh._next_probe - fresh.rounds)
    assert spacing == [every, 2 * every, 4 * every, 4 * every]
    fresh._note_probes([(0, 2, 2, 1, 2)], 2, 1.0, 0)  # one that keeps a draft starts over
    assert fresh._empty_gap == every
    fresh._probe_extra, fresh._next_probe = 2.0, fresh.rounds + 500  # a probe costs 2 plain rounds
    fresh._note_probes([(0, 2, 0, 0, 1)], 1, 1.0, 0)  # (a remote lookup's round trip)
    assert fresh._next_probe - fresh.rounds == int(2.0 / fresh.config.empty_probe_share)


def test_prompt_chunks_in_the_forward_do_not_make_losing_drafts_look_worth_their_time():
    """A round that carries prompt chunks costs b x their tokens whatever the depths. Priced
    into the round's rate, they lowered it, and drafts that lose against plain decoding
    looked worth it: a draft model at T = 0, batch 16, drafted 8 deep beside every batch's
    prompts (~60 ms rounds where plain decoding took ~26), ~6% of the time. The depths beside
    prompt chunks are those of the same batch without them."""
    ids = list(range(16))
    policy = SpeculationPolicy(CEILING)
    # Verify 1 ms + 0.2 ms a token: at batch 16 a drafted token (0.8 kept) costs more than
    # the plain tokens of its time.
    simulate(policy, dict.fromkeys(ids, 0.8), rounds=300, verify=(1e-3, 2e-4, 0.0))
    policy._next_solve = policy.rounds  # a solve now
    rows, ceiling = policy._gain(ids), [CEILING.max_depth] * len(ids)
    without = policy._depths(rows, ceiling, 0)
    policy._next_solve = policy.rounds
    beside = policy._depths(rows, ceiling, 256)
    assert not any(without) and beside == without


def test_empty_probes_are_spaced_by_what_empty_ones_measured_to_cost_in_rounds():
    """Once rounds without drafts are measured, an empty probe's cost is measured too (its
    worth over an off round's, in rounds: 16 sequences' off round is worth 16 tokens), and
    spaces the next ones, not what drafted probes cost (they verify their drafts as well): an
    in-process lookup's empty probes, a fifth of a round, come every `probe_every` rounds or
    so; a remote one's, two rounds (its round trip), ~100 rounds apart."""
    every = PolicyConfig().probe_every
    for cost_rounds, least, most in ((0.2, every, 4 * every), (2.0, 90, 110)):
        policy = SpeculationPolicy(CEILING)
        policy.check.kinds[False][:] = [160.0, 160.0, 10.0]  # off rounds: 16 tokens' worth each
        policy._probe_extra = 16.0 * 3.0  # drafted probes: three rounds (their verify too)
        spacing = []
        for _ in range(4):
            policy._next_probe = policy.rounds + 1000
            policy._note_probes([(s, 2, 0, 0, 1) for s in range(16)], 16, 16.0 * (1.0 + cost_rounds), 0)
            spacing.append(policy._next_probe - policy.rounds)
        assert policy._empty_extra == pytest.approx(16.0 * cost_rounds)
        assert all(least <= g <= most for g in spacing), spacing
        # A round with prompt chunks measures nothing (its worth is the chunks' too).
        policy._note_probes([(s, 2, 0, 0, 1) for s in range(16)], 16, 16.0 * 9.0, 64)
        assert policy._empty_extra == pytest.approx(16.0 * cost_rounds)


def test_sequences_turned_off_are_probed_until_drafts_pay_again():
    # probe_share 1: probes are never too dear here (the next test spaces dear ones).
    policy = SpeculationPolicy(CEILING, PolicyConfig(probe_every=4, max_probe_every=32, probe_share=1.0))

    def cost(
        depths,
    ):  # the same hardware throughout: verify 1 ms + 20 us a token, drafting 0.5 ms + 0.2 ms a step
        tokens = 2 + sum(depths)
        return tokens, 1e-3 + 2e-5 * tokens + 1e-4 * sum(k > 0 for k in depths), 5e-4 + 2e-4 * max(depths)

    simulate(policy, {7: 0.0, 8: 0.0}, rounds=30, verify=(1e-3, 2e-5, 1e-4), draft=(5e-4, 2e-4))
    probe_rounds = []
    for _ in range(120):
        depths = [b.max_depth for b in policy.budgets([7, 8], [CEILING] * 2, 0)]
        if any(depths):
            # A shared probe round: both at once, as shallow as a greedy probe may be.
            assert depths == [policy.config.greedy_probe_depth] * 2
            probe_rounds.append(policy.rounds)
        outcomes = [(s, k, k, 0, 1) for s, k in zip([7, 8], depths, strict=True)]
        tokens, round_s, draft_s = cost(depths)
        policy.observe(outcomes, tokens, round_s, max(depths), draft_s * bool(any(depths)))
    gaps = [b - a for a, b in zip(probe_rounds, probe_rounds[1:], strict=False)]
    assert len(gaps) >= 10 and min(gaps) >= policy.config.min_probe_every
    # The text turns predictable: a probe sees its draft kept, and speculation comes back
    # (but for the goodput check's off probes).
    late = []
    for i in range(80):
        depths = [b.max_depth for b in policy.budgets([7, 8], [CEILING] * 2, 0)]
        late += [min(depths)] if i >= 60 and not policy.check.off_probe else []
        outcomes = [(s, k, k, k, k + 1) for s, k in zip([7, 8], depths, strict=True)]
        tokens, round_s, draft_s = cost(depths)
        policy.observe(outcomes, tokens, round_s, max(depths), draft_s * bool(any(depths)))
    assert len(late) >= 15 and min(late) >= 2


def probe_gaps(probe_extra_s: float, rounds: int = 600) -> list[int]:
    """Rounds between probes of two sequences whose drafts are always lost, when a probe round
    costs `probe_extra_s` more than a 1 ms round without drafts (asking a sequence to draft
    costs 0.1 ms besides: were it free, a depth-1 draft would pay on the prior's hope alone)."""
    policy = SpeculationPolicy(CEILING, PolicyConfig(probe_every=4, max_probe_every=32, probe_share=0.05))
    simulate(policy, {7: 0.0, 8: 0.0}, rounds=30, verify=(1e-3, 1e-5, 1e-4), draft=(0.0, 0.0))
    probe_rounds = []
    for _ in range(rounds):
        depths = [b.max_depth for b in policy.budgets([7, 8], [CEILING] * 2, 0)]
        probing = any(depths)
        if probing:
            probe_rounds.append(policy.rounds)
        outcomes = [(s, k, k, 0, 1) for s, k in zip([7, 8], depths, strict=True)]
        cost_s = 1e-3 + 1e-4 * sum(k > 0 for k in depths) + probe_extra_s * probing
        policy.observe(outcomes, 2 + sum(depths), cost_s, max(depths), 0.0)
    return [b - a for a, b in zip(probe_rounds, probe_rounds[1:], strict=False)]


def test_dear_probes_are_spaced_to_cost_about_their_share_of_the_time():
    """A probe that costs 5 ms beyond a 1 ms round (a drafter catching up on a long sequence)
    may come only every ~100 rounds at a 5% share (jittered x0.5 to x1.5); one that costs next
    to nothing comes every `min_probe_every` rounds."""
    cheap, dear = probe_gaps(1e-5), probe_gaps(5e-3)
    assert set(cheap[2:]) == {PolicyConfig().min_probe_every}
    assert min(dear[-3:]) >= 45 and sum(dear[-3:]) >= 3 * 70 and max(dear) <= 1.5 * 4 * 32  # once measured
    assert len(dear) <= len(cheap) / 2


def test_fixed_drafts_the_ceiling_and_warmup_cycles_the_depths():
    fixed = SpeculationPolicy(CEILING, PolicyConfig(adaptive=False))
    assert simulate(fixed, {0: 0.0}, rounds=30, verify=(1e-3, 1e-3, 1e-4), draft=(5e-4, 1e-3)) == {0: 8}
    fresh = SpeculationPolicy(CEILING, PolicyConfig(warmup_cycles=1))
    warmup = []
    for _ in range(9):  # the first rounds cycle 0 .. ceiling (within each sequence's own limit)
        warmup.append([b.max_depth for b in fresh.budgets([1, 2], [CEILING, TreeBudget(3, 2, 1)], 0)])
        fresh.observe([(1, 0, 0, 0, 1), (2, 0, 0, 0, 1)], 2, 1e-3, 0, 0.0)
    assert [w[0] for w in warmup] == list(range(9)) and [w[1] for w in warmup] == [0, 1, 2, 2, 2, 2, 2, 2, 2]


def test_never_plans_deeper_than_the_drafter_drafts():
    """A drafter that drafts at most 3 tokens (its own K) however deep the budget: depths past
    4 earn nothing, so the policy never pays for them."""
    policy = SpeculationPolicy(CEILING)
    rng = random.Random(1)
    depths = [8]
    for _ in range(40):
        drafted = min(depths[0], 3)
        kept = sum(1 for _ in range(drafted) if rng.random() < 0.95)
        policy.observe(
            [(0, depths[0], drafted, kept, kept + 1)], drafted + 1, 1e-3 + 1e-4 * drafted, depths[0], 1e-4
        )
        depths = [b.max_depth for b in policy.budgets([0], [CEILING], 0)]
    assert depths[0] <= 4


def test_predicted_and_measured_tokens_are_kept_for_metrics():
    policy = SpeculationPolicy(CEILING)
    simulate(policy, {0: 0.8}, rounds=50)
    stats = policy.stats
    assert stats.measured_tokens > 0 and stats.predicted_tokens == pytest.approx(
        stats.measured_tokens, rel=0.3
    )
    assert sum(stats.depth_counts) == 50


def test_a_drafter_that_finds_nothing_is_turned_off():
    """Asked for drafts, an n-gram drafter that matches nothing answers root-only trees: that
    earns nothing, so the policy stops asking (but for probes)."""
    policy = SpeculationPolicy(CEILING)
    depths = [8]
    for _ in range(60):
        cost = 1e-3 + 2e-4 * (depths[0] > 0)
        policy.observe([(0, depths[0], 0, 0, 1)], 1, cost, depths[0], 3e-4 * bool(depths[0]))
        depths = [b.max_depth for b in policy.budgets([0], [CEILING], 0)]
    assert policy.stats.depth_counts[0] > 30 and depths[0] <= 1


def test_measured_goodput_vetoes_drafts_the_cost_model_favours_then_retries_them_afresh():
    """The solver drafts deep (cheap drafts, kept), but rounds with drafts measured fewer
    committed tokens per plain-equivalent token than rounds without: drafting is vetoed for
    `probe_every` rounds, then retried on fresh evidence; a retry that measures slower again
    is vetoed twice as long."""
    policy = SpeculationPolicy(CEILING, PolicyConfig(probe_every=8))
    assert min(simulate(policy, {0: 0.9, 1: 0.9}, rounds=60).values()) >= 5

    def run(rounds: int, slow: bool) -> list[int]:
        """Each round's depths; drafts are kept, and drafting rounds cost 20 ms (slow)
        or 1 ms + 1 us a token (as rounds without drafts)."""
        least: list[list[int]] = []
        for _ in range(rounds):
            depths = [b.max_depth for b in policy.budgets([0, 1], [CEILING] * 2, 0)]
            least.append(depths)
            tokens = 2 + sum(depths)
            round_s = 2e-2 if slow and any(depths) else 1e-3 + 1e-6 * tokens
            policy.observe(
                [(s, k, k, k, k + 1) for s, k in zip([0, 1], depths, strict=True)], tokens, round_s, 0, 0.0
            )
        return least

    # From here the solver always wants the ceiling (a cost model that is wrong), so only the
    # measured check holds it back.
    policy._depths = lambda rows, ceiling, prefill_tokens: list(ceiling)
    config, n = policy.config, 20.0
    policy.check.kinds = {True: [n, 2 * n, n], False: [n, n, n]}  # 0.5 vs 1 committed per plain token
    # Drafting rounds a retry takes to gather the decayed rounds of evidence a check needs.
    need = next(
        i
        for i in range(1, 100)
        if sum(config.goodput_decay**j for j in range(i)) >= config.goodput_min_rounds
    )
    first = run(8 + need + 2, slow=True)
    # Vetoed 8 rounds (a shared depth-1 probe aside), then retried (an off probe may come first).
    assert max(map(max, first[:8])) <= 1 and sum(min(d) >= 5 for d in first[8:]) >= need - 2
    second = run(60, slow=False)  # the retry measured slower: vetoed 16 rounds now
    # The longest stretch without drafting after the retry (it may begin in `first`).
    drafting = [min(d) >= 5 for d in first[8:] + second]
    stretches, run_length = [], 0
    for drafted in drafting:
        run_length = 0 if drafted else run_length + 1
        stretches.append(run_length)
    assert 16 <= max(stretches) <= 17  # (an off probe may come just before)
    back = len(first) - 8 + len(second) - stretches[::-1].index(max(stretches))
    # Fast now: drafting stays (off probes aside).
    assert sum(drafting[back:]) >= len(drafting) - back - 4


def test_trees_narrower_than_their_budget_are_priced_by_the_nodes_they_carry():
    """A budget of 6 nodes per depth, and a drafter that drafts chains (1 node per depth, as a
    lookup's tree is as wide as its matches) kept 90% of the time, verify 1 ms + 1 ms a token:
    chains of 2-4 pay (2.7 tokens for 4 ms at depth 2, 3.4 for 5 ms at 3, against 1 for 2 ms).
    Priced at the budget's width (7 nodes at depth 1, 13 at depth 2) none would."""
    wide = TreeBudget(max_nodes=25, max_depth=4, top_k=6)
    policy, rng, k, given = SpeculationPolicy(wide), random.Random(2), 4, []
    for _ in range(200):
        kept = 0
        while kept < k and rng.random() < 0.9:
            kept += 1
        outcome = [(0, k, k, kept, kept + 1)]
        policy.observe(outcome, 1 + k, 1e-3 * (2 + k), k, 0.0, draft_nodes=[k])
        k = policy.budgets([0], [wide], 0)[0].max_depth
        given.append(k)
    assert sum(k >= 2 for k in given[100:]) >= 90


def test_a_drafter_catching_up_after_a_pause_is_not_priced_as_if_it_always_did():
    """The drafter's wait grows with the tokens it was sent (0.2 ms each: a probe after 30
    rounds off catches up on 30 tokens). Drafts are lost for a while, so speculation is off and
    only probes draft; then the text turns predictable (kept 90%): drafting every round sends
    ~5 tokens a round and pays, so the policy drafts deep again. Fitting the probes' waits as
    a fixed cost per round (6 ms) would keep it off. (A probe catching up on ~500 tokens
    costs ~100 rounds here, so probes come hundreds of rounds apart: `probe_share`.)"""
    policy, rng = SpeculationPolicy(CEILING), random.Random(3)
    unsent, sent, depths, late = 0, 0, [8], []
    for i in range(1100):
        keeps = 0.0 if i < 300 else 0.9
        k, kept = depths[0], 0
        while kept < k and rng.random() < keeps:
            kept += 1
        unsent += kept + 1
        wait = 1e-4 + 1e-4 * k + 2e-4 * sent if k else 0.0
        policy.observe([(0, k, k, kept, kept + 1)], 1 + k, 1e-3 + 2e-4 * (1 + k), k, wait)
        depths = [b.max_depth for b in policy.budgets([0], [CEILING], 0)]
        sent = unsent if depths[0] else 0
        unsent -= sent
        policy.sent(sent)
        if i >= 900:
            late.append(depths[0])
    assert sum(k >= 4 for k in late) >= 170


def test_greedy_and_sampled_sequences_have_their_own_batch_wide_prior():
    """What greedy sequences keep (loops at T = 0 keep nearly everything) must not become the
    prior of a new sampled sequence: its expected tokens start from the sampled class's
    counts (none yet: the neutral 0.5 keep rate), a new greedy one from the greedy class's."""
    policy = SpeculationPolicy(CEILING)
    rng = random.Random(0)
    k = [CEILING.max_depth] * 2
    for _ in range(80):
        outcomes = []
        for seq_id, depth in zip((0, 1), k, strict=True):
            kept = 0
            while kept < depth and rng.random() < 0.95:
                kept += 1
            outcomes.append((seq_id, depth, depth, kept, kept + 1))
        policy.observe(outcomes, sum(k) + 2, 1e-3, max(k), 2e-4)
        k = [b.max_depth for b in policy.budgets([0, 1], [CEILING] * 2, 0, greedy=[True, True])]
    policy.budgets([0, 1, 2, 3], [CEILING] * 4, 0, greedy=[True, True, False, True])
    tokens = [row[0][1] for row in policy._gains([2, 3])]  # expected committed tokens at depth 1
    assert tokens[0] == pytest.approx(1.5)  # sampled: nothing learnt about its class yet
    assert tokens[1] > 1.85  # greedy: the batch's 0.95


def test_a_request_ending_does_not_hold_the_next_one_off():
    """At a request's end its own ceiling drops to 0 (no token left to draft for); a solve then
    is not the batch's answer. Kept, it held the next request off (or shallow) until the next
    solve: at batch 1, the first rounds of every request."""
    policy = SpeculationPolicy(CEILING)
    simulate(policy, {0: 0.9}, rounds=60)
    ending = TreeBudget(max_nodes=1, max_depth=0, top_k=1)
    for _ in range(2 * policy.config.resolve_every):  # a due solve falls inside
        depth = policy.budgets([0], [ending], 0)[0].max_depth
        policy.observe([(0, depth, depth, 0, 1)], 1, 1e-3, depth, 0.0)
    policy.forget(0)
    depths = []
    for _ in range(4):
        depth = policy.budgets([1], [CEILING], 0)[0].max_depth
        depths.append(depth)
        kept = max(depth - 1, 0)
        policy.observe([(1, depth, depth, kept, kept + 1)], 1 + depth, 1e-3 + 5e-5 * depth, depth, 2e-4)
    assert sorted(depths)[1] >= 4, depths  # one round may be an off probe (goodput check)


def test_short_requests_are_solved_on_the_usual_schedule():
    """Requests whose own ceiling is always below the policy's (max_tokens under the ceiling)
    are solved every `resolve_every` rounds like any other, not every round."""
    policy = SpeculationPolicy(CEILING)
    solves = []
    solve = policy.verify_cost.solve
    policy.verify_cost.solve = lambda: solves.append(policy.rounds) or solve()
    short = TreeBudget(max_nodes=3, max_depth=2, top_k=1)
    depth = 0
    for _ in range(80):
        kept = max(depth - 1, 0)
        policy.observe([(0, depth, depth, kept, kept + 1)], 1 + depth, 1e-3 + 5e-5 * depth, depth, 2e-4)
        depth = policy.budgets([0], [short], 0)[0].max_depth
    after_warmup = [r for r in solves if r > 2 * (CEILING.max_depth + 1)]
    assert 3 <= len(after_warmup) <= 80 // policy.config.resolve_every + 1, solves


# A compute-bound CPU: any draft at all costs a step (a one-token forward to a many-token one).
STEP = (5e-3, 2e-4, 5e-3)


def drafting_deep() -> SpeculationPolicy:
    """A policy that has drafted one sequence (90% kept) at the ceiling on a `STEP` CPU."""
    policy = SpeculationPolicy(CEILING)
    simulate(policy, {0: 0.9}, rounds=60, verify=STEP, draft=(1e-4, 0.0))
    return policy


def step_round(policy: SpeculationPolicy, depth: int, kept: int) -> None:
    """Sequence 0's round at `depth`, `kept` of it kept, priced as on a `STEP` CPU."""
    round_s = STEP[0] + STEP[1] * (1 + depth) + STEP[2] * (depth > 0)
    policy.observe([(0, depth, depth, kept, kept + 1)], 1 + depth, round_s, depth, 1e-4)


def test_a_sequence_near_its_end_drafts_what_still_pays_between_solves():
    """A request's last rounds cap its depth (2 tokens left: depth 2 at most). Between solves
    the rate lam must follow: judged at the old lam (that of depth 8, ~500 tokens/s), the
    depth-2 tree (~250/s here) lost to plain decoding (~190/s) and the request ended off."""
    policy = drafting_deep()
    assert policy.budgets([0], [CEILING], 0)[0].max_depth == CEILING.max_depth
    capped = TreeBudget(max_nodes=3, max_depth=2, top_k=1)
    depths = []
    for _ in range(3):
        depth = policy.budgets([0], [capped], 0)[0].max_depth
        depths.append(depth)
        step_round(policy, depth, kept=depth)
    assert depths.count(2) >= 2, depths  # one may be an off probe


def test_rounds_without_drafts_stand_in_for_off_probes():
    """The goodput check measures rounds without drafts; at batch 1 each request's last round
    is one (no token left to draft for). Off probes then only add lost tokens."""
    policy = drafting_deep()
    ending = TreeBudget(max_nodes=1, max_depth=0, top_k=1)
    probes = policy.stats.off_probes
    for r in range(300):
        limit = ending if r % 10 == 9 else CEILING
        depth = policy.budgets([0], [limit], 0)[0].max_depth
        step_round(policy, depth, kept=int(depth * 0.9))
    assert policy.stats.off_probes - probes <= 1


@pytest.mark.parametrize("scalar_fold", [0, 10_000])  # numpy folds, row-by-row folds
def test_quiet_rounds_decide_as_the_full_path_does(monkeypatch, scalar_fold):
    """While speculation is off with nothing due, the engine skips `budgets` (`quiet`) and
    the round is only measured (`observe_quiet`): the decisions, counters and measurements
    are those of the full path, round for round, and most rounds are quiet."""
    monkeypatch.setattr(policy_quiet, "SCALAR_FOLD", scalar_fold)

    def drive(quiet: bool) -> tuple[list[int], SpeculationPolicy, int]:
        policy, rng = SpeculationPolicy(CEILING), random.Random(0)
        simulate(policy, {0: 0.05}, rounds=30, verify=(1e-3, 1e-3, 1e-4), draft=(5e-4, 1e-3))
        depths, quiet_rounds = [], 0
        for _ in range(400):
            if quiet and policy.quiet(1):
                quiet_rounds += 1
                depths.append(0)
                policy.observe_quiet(1, 0, 2e-3)
                continue
            depth = policy.budgets([0], [CEILING], 0)[0].max_depth
            depths.append(depth)
            kept = int(depth > 0 and rng.random() < 0.05)
            round_s = 1e-3 + 1e-3 * (1 + depth) + 1e-4 * (depth > 0)
            wait_s = 5e-4 + 1e-3 * depth if depth else 0.0
            policy.observe([(0, depth, depth, kept, kept + 1)], 1 + depth, round_s, depth, wait_s)
        return depths, policy, quiet_rounds

    full, full_policy, _ = drive(quiet=False)
    fast, fast_policy, quiet_rounds = drive(quiet=True)
    assert fast == full
    assert quiet_rounds > 300
    stats = ("depth_counts", "rounds_off", "vetoed_rounds", "off_probes")
    assert [getattr(fast_policy.stats, k) for k in stats] == [getattr(full_policy.stats, k) for k in stats]
    fast_policy._fold_quiet()  # (the quiet rounds' log, as the next `budgets` would)
    for kind in (True, False):
        assert fast_policy.check.kinds[kind] == pytest.approx(full_policy.check.kinds[kind])
    for name in ("forward", "rest"):
        fast_fit, full_fit = getattr(fast_policy.verify_cost, name), getattr(full_policy.verify_cost, name)
        assert fast_fit.solve() == pytest.approx(full_fit.solve())
        assert fast_fit.xtx / fast_fit._weight == pytest.approx(full_fit.xtx / full_fit._weight)


def test_a_drafter_wait_that_stops_paying_is_weighed_between_solves():
    """A draft model's wait (11 ms at depth 8) against 5 ms rounds: worth it while 90% of
    drafts are kept, not once 5% are. Each sequence's own costs are small beside the wait,
    so not drafting at all must be weighed between solves too: with the wait priced as paid
    whatever the sequence chose, it drafted at depth 8 until the next solve (40 rounds on)."""
    verify, draft = (5e-3, 2e-4, 1e-4), (3e-3, 1e-3)
    policy = SpeculationPolicy(CEILING)
    assert simulate(policy, {0: 0.9}, rounds=300, verify=verify, draft=draft)[0] >= 5
    next_solve = policy._next_solve
    assert next_solve - policy.rounds > 30  # solves kept their answer: spaced wide
    depths, rng = [], random.Random(1)
    while depths[-3:] != [0, 0, 0]:
        depth = policy.budgets([0], [CEILING], 0)[0].max_depth
        depths.append(depth)
        kept = 0
        while kept < depth and rng.random() < 0.05:
            kept += 1
        round_s = verify[0] + verify[1] * (1 + depth) + verify[2] * (depth > 0)
        wait_s = draft[0] + draft[1] * depth if depth else 0.0
        policy.observe([(0, depth, depth, kept, kept + 1)], 1 + depth, round_s, depth, wait_s)
    assert policy.rounds < next_solve - 20, depths


def test_a_probe_drafts_as_deep_as_the_batch_wide_counts_say_pays():
    """A tree with drafts costs 3 ms beyond a 2.7 ms round whatever its depth (this CPU's
    verify): a depth-1 probe of a sequence that has started to loop keeps 1 token for that
    price and teaches nothing past depth 1. Where the class's batch-wide counts say deep
    drafts are kept (sequence 1 loops), a sequence turned off (2, prose) is probed that deep,
    and is back at full depth the round after its text turns predictable."""
    policy = SpeculationPolicy(CEILING, PolicyConfig(probe_share=1.0))
    rng, accept = random.Random(0), {1: 0.95, 2: 0.0}
    depths = [CEILING.max_depth] * 2

    def step() -> None:
        outcomes = drafted(rng, accept, list(accept), depths)
        round_s = 2.7e-3 + 1e-4 * (2 + sum(depths)) + 3e-3 * any(depths)
        policy.observe(outcomes, 2 + sum(depths), round_s, max(depths), 1e-4 * any(depths))
        depths[:] = [b.max_depth for b in policy.budgets(list(accept), [CEILING] * 2, 0)]

    seen = []
    for _ in range(200):
        step()
        seen += [depths[1]] if policy.rounds > 100 else []
    back = [k for was, k in zip(seen, seen[1:], strict=False) if not was and k]  # off, then asked
    assert seen.count(0) > 0.2 * len(seen) and back and min(back) >= 4  # (probes: depth 1, before)
    while not depths[1]:  # until the next probe
        step()
    accept[2] = 1.0
    step()
    assert depths[1] >= 6


def test_a_probe_is_as_shallow_as_allowed_where_the_batch_wide_counts_say_drafts_are_lost():
    """1 deep where those counts are all it knows; greedy sequences (these) at least
    `greedy_probe_depth`, so a probe that lands in a loop can show it pays."""
    policy = SpeculationPolicy(CEILING, PolicyConfig(probe_share=1.0))
    simulate(policy, {1: 0.02}, rounds=120, verify=(2.7e-3, 1e-4, 3e-3), draft=(1e-4, 1e-5))
    probes = []
    for _ in range(200):
        k = policy.budgets([1], [CEILING], 0)[0].max_depth
        probes += [k] if k else []
        policy.observe([(1, k, k, 0, 1)], 1 + k, 2.7e-3 + 3e-3 * (k > 0), 0, 0.0)
    assert probes and set(probes) == {policy.config.greedy_probe_depth}


def test_greedy_probes_go_back_to_depth_1_where_deep_ones_kept_their_drafts_and_lost():
    """Drafts seldom kept (the batch-wide counts say depth 1), but those of probes are (a
    loop) and cost more than they commit (each draft token 3 ms): once greedy probes
    `greedy_probe_depth` deep have measured that, probes are 1 deep; that evidence decays
    with every probe, so the floor comes back to look again."""
    policy = SpeculationPolicy(CEILING, PolicyConfig(probe_share=1.0))
    simulate(policy, {1: 0.02}, rounds=120, verify=(2.7e-3, 1e-4, 3e-3), draft=(1e-4, 1e-5))
    probes = []
    while len(probes) < 4:
        k = policy.budgets([1], [CEILING], 0)[0].max_depth
        probes += [k] if k else []
        policy.observe([(1, k, k, k, k + 1)], 1 + k, 2.7e-3 + 3e-3 * k + 3e-3 * (k > 0), 0, 0.0)
    deep = policy.config.greedy_probe_depth
    assert probes == [deep, deep, deep, 1] and policy._greedy_floor() == 1
    for _ in range(40):  # shallow probes only: the deep ones' evidence decays
        policy._note_probe(True, -1.0, 1.0, kept=1.0)
    assert policy._greedy_floor() == deep


def test_probes_are_spaced_by_what_they_find_as_well_as_by_what_they_cost():
    policy = SpeculationPolicy(CEILING, PolicyConfig())
    policy._probe_extra = 2.0  # a probe round costs 2 plain-equivalent tokens more than an off one
    assert policy._value_gap(True) is None  # nothing measured: the cost-based spacing alone
    policy.forget(0, tokens=128)  # sequences live 128 tokens: a paying stretch, up to 64 on average
    assert policy._value_gap(True) is None  # no probe yet
    for _ in range(200):  # probes that found nothing, though a kept one would gain 0.5 (T = 1)
        policy._note_probe(True, -1.0, 0.5)
    idle = policy._value_gap(True)
    assert idle > 2.0 / policy.config.probe_share / 2  # about the cost-based spacing: finds assumed rare
    for _ in range(3):  # now one chain in four turns speculation on, its best round gaining 1.5
        for gain in (-1.0, -1.0, -1.0, 1.5):
            policy._note_probe(True, gain, 2.0)
        policy._note_find(True)
    f = policy._finds[True]
    h = (f.finds + 0.5 * f.prior_weight) / (f.probes + f.prior_weight)
    assert f.prior_weight < 1e-4  # 212 probes on: the prior has all but faded
    expected = (2 * 0.5 * f.life * (1 - h) * 2.0 / (h * f.gain / f.finds)) ** 0.5
    assert abs(f.gain / f.finds - 1.5) < 1e-9
    assert abs(policy._value_gap(True) - expected) < 1e-9
    assert policy.config.min_probe_every < policy._value_gap(True) < idle / 2


def test_a_find_brings_the_next_probe_forward():
    policy = SpeculationPolicy(CEILING, PolicyConfig())
    policy._probe_extra, policy._last_probe, policy._next_probe = 2.0, 100, 356  # planned by cost
    policy.forget(0, tokens=128)
    policy._note_probe(True, 3.0, 3.0)  # the probe at round 100 kept its drafts, and the solve turned on
    policy._note_find(True)
    assert 100 + policy.config.min_probe_every <= policy._next_probe < 356
    assert policy._next_probe == 100 + int(policy._value_gap(True))


def test_sequences_that_start_to_loop_mid_life_are_found_though_probes_are_expensive():
    """Requests of 128 rounds at batch 1 whose drafts are lost for the first half of their
    life and kept in the second (greedy text that starts to loop), with a drafter whose every
    round costs twice a round without drafts (a remote one's round trip): probes must come
    often enough to find the loops, not once per 200 rounds (what 1% of the time allows)."""
    ceiling = TreeBudget(max_nodes=5, max_depth=4, top_k=1)
    policy = SpeculationPolicy(ceiling, PolicyConfig())
    rng = random.Random(0)
    on_in_loops = loop_rounds = 0
    for request in range(12):
        depths = [b.max_depth for b in policy.budgets([request], [ceiling], 0)]
        for position in range(128):
            looping = position >= 64
            k = depths[0]
            kept = 0
            while kept < k and rng.random() < (0.95 if looping else 0.05):
                kept += 1
            round_s = 2e-3 + 1e-4 * (k + 1) + (1e-3 if k else 0.0)
            policy.observe([(request, k, k, kept, kept + 1)], k + 1, round_s, k, 2e-3 if k else 0.0)
            if request >= 4 and looping:
                loop_rounds += 1
                on_in_loops += k > 0
            depths = [b.max_depth for b in policy.budgets([request], [ceiling], 0)]
        policy.forget(request, tokens=128)
    assert on_in_loops / loop_rounds > 0.5


def test_what_greedy_probes_find_does_not_space_sampled_ones():
    policy = SpeculationPolicy(CEILING, PolicyConfig())
    policy._probe_extra = 1.0
    policy.budgets([0, 1], [CEILING, CEILING], 0, greedy=[True, False])
    policy.forget(0, tokens=128)  # greedy
    for _ in range(4):
        policy._note_probe(True, 2.0, 3.0)
        policy._note_find(True)
    assert policy._value_gap(True) is not None
    assert policy._value_gap(False) is None  # no sampled probe measured: the cost-based spacing
    policy.forget(1, tokens=96, greedy=False)
    assert policy._finds[False].life == 96 and policy._finds[True].life == 128  # lives kept apart


def test_finds_without_probes_mean_probing_as_often_as_allowed():
    policy = SpeculationPolicy(CEILING, PolicyConfig())
    policy._probe_extra = 1.0
    policy.forget(0, tokens=64)
    policy._note_probe(True, 1.0, 2.0)
    for _ in range(3):  # solves that turned speculation on with no probe between them
        policy._note_find(True)
    assert policy._value_gap(True) == 0.0


def test_the_greedy_prior_fades_where_probes_never_find_a_stretch_that_pays():
    """Half a find per pseudo-probe is a hope, weighed like the probes it is set against: a
    drafter whose kept probes would pay but never turn speculation on (an EAGLE head at T = 0
    whose drafts did not pay even in loops) is probed, after a while, no more often than
    `probe_share` allows, not ~100 rounds apart forever."""
    policy = SpeculationPolicy(CEILING, PolicyConfig(probe_share=0.01))
    policy._probe_extra = 5.0  # a head's probe: its catch-up on the rounds since the last
    policy.forget(0, tokens=128)
    cost_spacing = policy._probe_extra / policy.config.probe_share
    gaps = []
    for _ in range(80):
        policy._note_probe(True, -4.0, 2.8)  # a kept probe would gain 2.8; none is kept enough
        gaps.append(policy._value_gap(True))
    assert gaps[4] < cost_spacing / 4  # early: the prior's hope spaces them
    assert gaps[-1] > cost_spacing  # later: evidence rules, the cost-based spacing takes over
    assert all(a <= b for a, b in zip(gaps, gaps[1:], strict=False))


def test_finds_are_worth_what_the_drafting_they_turn_on_measured():
    """Probes that keep their drafts in loops space probes close; if the drafting rounds the
    solver then chose measured less than rounds without drafts, finds are worth nothing and
    the cost-based spacing rules (a draft model at T = 0: each probe is a catch-up)."""
    policy = SpeculationPolicy(CEILING, PolicyConfig())
    policy._probe_extra = 2.0
    policy.forget(0, tokens=64)
    for _ in range(3):
        for gain in (-1.0, 3.0):
            policy._note_probe(True, gain, 4.0)
        policy._note_find(True)
    hopeful = policy._value_gap(True)
    assert hopeful is not None and hopeful < 16
    policy.check.kinds[True] = [30.0, 28.0, 20.0]  # drafting rounds: +0.1 token a round, measured
    assert policy._value_gap(True) > hopeful
    policy.check.kinds[True] = [24.0, 28.0, 20.0]  # and where they lost
    assert policy._value_gap(True) is None and policy._probe_loss(True) is None


def test_probes_that_kept_their_drafts_and_lost_end_the_hope():
    """Before any find, the hope (every draft kept would gain 6 tokens a probe round) spaces
    probes close; probes that kept ~80% of their drafts and still lost (a draft model at
    T = 0, batch 16, in one process: each probe catches 16 sequences up) measure it instead:
    finds would be worth nothing, and the cost-based spacing rules. Probes that kept nothing
    (a lookup before its text loops) say nothing of it, and leave the hope as it was."""
    hopes = []
    for kept in (0.8, 0.0):
        policy = SpeculationPolicy(CEILING, PolicyConfig())
        policy._probe_extra = 20.0
        policy.forget(0, tokens=64)
        policy._note_probe(True, -12.0, 6.0, kept)
        policy._note_probe(True, -10.0, 6.0, kept)
        hopes.append(policy._value_gap(True))
    assert hopes[0] is None  # measured: kept drafts lost
    assert hopes[1] is not None and hopes[1] < 20.0 / PolicyConfig().probe_share


def policy_after_a_find() -> SpeculationPolicy:
    """A policy whose one probe chain (its best round +0.8 plain tokens) turned drafting on."""
    policy = SpeculationPolicy(CEILING, PolicyConfig())
    policy._probe_extra = 6.0
    policy.forget(0, tokens=100)
    policy._note_probe(True, 0.8, 0.8, 1.0)
    policy._chain = 1
    policy._note_find(True)
    policy._chain = 0
    return policy


def test_a_find_is_worth_no_more_than_probes_that_kept_their_drafts_gained():
    """An early find (its chain's best round: +0.8 plain tokens) spaced probes on its hope;
    the probes after it kept every draft, in loops, and lost ~1 plain token each (an MTP head
    at T = 0: dearer than the tokens it keeps on this CPU). A stretch that keeps the drafts
    gains what those probes did: the find is worth nothing, and the cost-based spacing rules."""
    policy = policy_after_a_find()
    hopeful = policy._value_gap(True)
    assert hopeful is not None and hopeful < 6.0 / PolicyConfig().probe_share
    for _ in range(6):
        policy._note_probe(True, -1.0, -1.0, 1.0)
    assert policy._value_gap(True) is None
    # Probes that kept nothing (text that stopped looping) say nothing of a stretch that does.
    policy = policy_after_a_find()
    for _ in range(6):
        policy._note_probe(True, -1.0, 3.0, 0.0)
    assert policy._value_gap(True) is not None


def test_a_batched_drafters_cost_grows_with_the_draft_tokens_asked():
    """draft(m, U, K) = c + e m + g U + h K: the fit tells e from h once the batch varies,
    and each sequence's own depth is priced h a token."""
    policy = SpeculationPolicy(CEILING, PolicyConfig())
    for batch in (1, 4, 16, 1, 8):
        for m in range(1, 9):
            policy.draft_cost.add((m, 0, m * batch), 1e-3 + 2e-4 * m + 5e-5 * m * batch)
    c, e, g, h = policy.draft_cost.solve()
    assert c == pytest.approx(1e-3, rel=0.05) and e == pytest.approx(2e-4, rel=0.05)
    assert h == pytest.approx(5e-5, rel=0.05)  # (the ridge's pull aside)
    rows = [([1.0, 1.9, 2.7], [1.0, 2.0, 3.0], [0.0, 1.0, 1.0])]
    (seconds,) = sequence_seconds(rows, 1e-4, 0.0, 0.0, 0.0, h)
    assert abs(seconds[2] - seconds[1] - (1e-4 + h)) < 1e-12


def test_a_round_whose_trees_all_missed_the_deadline_turns_drafting_off_at_once():
    """A remote drafter late for every tree (a wave of new prompts to catch up on, then every
    row to draft): the next rounds at that batch size do not draft, however much the solver
    likes the drafts, until `probe_every` rounds on; a round answered in time changes nothing."""
    policy = SpeculationPolicy(CEILING, PolicyConfig(probe_every=8))
    ids = list(range(16))
    assert min(simulate(policy, dict.fromkeys(ids, 0.9), rounds=60).values()) >= 5

    def late_round(missing: int) -> list[int]:
        depths = [b.max_depth for b in policy.budgets(ids, [CEILING] * 16, 0)]
        outcomes = [(s, k, 0 if missing else k, 0 if missing else k, 1 if missing else k + 1)
                    for s, k in zip(ids, depths, strict=True)]  # fmt: skip
        policy.observe(outcomes, 16, 2e-3, max(depths), 5e-2 if missing else 1e-3, missing=missing)
        return depths

    assert min(late_round(0)) >= 5 and min(late_round(0)) >= 5  # answered in time: as before
    # As after a veto's retry: the goodput check needs `goodput_min_rounds` drafting rounds
    # before it can veto again, and does not hold drafting back meanwhile.
    policy.check.kinds[True] = [0.0, 0.0, 0.0]
    assert min(late_round(16)) >= 5  # every tree late
    after = [late_round(0) for _ in range(8)]  # (no tree asked for: none can be late)
    assert not any(map(any, after[:7]))  # (a shared depth-1 probe aside: none due here)
    assert min(late_round(0)) >= 5  # the retry, answered in time: drafting again
    # At a smaller batch the veto does not hold (no off probe due there either).
    policy.check.late(16, True, policy.rounds)
    policy.check.select(2).next_off = policy.rounds + 1
    assert any(b.max_depth for b in policy.budgets([0, 1], [CEILING] * 2, 0))


def test_a_batch_of_a_new_size_is_not_probed_at_once_while_the_drafter_is_late_for_fewer():
    """Off at batch 1, a batch of 16 is probed at once (`_draft_cost_at`), unless the drafter
    just missed its deadline for 4 sequences: then it would miss it for 16 too."""
    ids = list(range(16))
    for late in (False, True):
        policy = SpeculationPolicy(CEILING)
        simulate(policy, {0: 0.05}, rounds=60, verify=(1e-3, 1e-3, 1e-4), draft=(5e-4, 1e-3))
        assert policy._solved[0] == 0 and policy._next_probe > policy.rounds + 1
        if late:
            policy.check.late(4, True, policy.rounds)
        assert any(b.max_depth for b in policy.budgets(ids, [CEILING] * 16, 0)) != late


def test_a_probe_late_for_every_tree_is_a_lost_probe_not_an_empty_one():
    """Off, a probe whose trees all missed the deadline cost the deadline and found nothing:
    not spaced as probes the drafter had nothing for (`_empty_gap`, `_empty_extra`)."""
    policy = SpeculationPolicy(CEILING)
    simulate(policy, {0: 0.05, 1: 0.05}, rounds=60, verify=(1e-3, 1e-3, 1e-4), draft=(5e-4, 1e-3))
    assert policy._solved[0] == 0
    before = (policy._empty_extra, policy._empty_gap, policy._finds[True].probes)
    outcomes = [(0, 2, 0, 0, 1), (1, 2, 0, 0, 1)]
    policy.observe(outcomes, 2, 2e-3, 2, 5e-2, missing=2)
    assert (policy._empty_extra, policy._empty_gap) == before[:2]
    assert policy._finds[True].probes > before[2]  # noted as a probe that lost
    policy.observe(outcomes, 2, 2e-3, 2, 1e-3)  # the drafter answered, root-only: empty
    assert policy._empty_gap == 2 * before[1]


def test_a_rows_seconds_are_kept_while_the_row_and_the_cost_terms_are():
    """`_seconds` reuses a row's `sequence_seconds` while `_gain` reuses the row, and works
    them out afresh for a new row or new cost terms."""
    policy = SpeculationPolicy(CEILING)
    rows = policy._gain([0, 1])
    terms = (1e-4, 2e-5, 1e-5, 1e-6, 3e-6)
    first = policy._seconds(rows, terms)
    assert first == sequence_seconds(rows, *terms)
    assert all(a is b for a, b in zip(policy._seconds(rows, terms), first, strict=True))
    other = (2e-4, *terms[1:])
    assert policy._seconds(rows, other) == sequence_seconds(rows, *other)
    fresh = ([1.0, 1.5, *rows[0][0][2:]], rows[0][1], rows[0][2])  # a refreshed row
    assert policy._seconds([fresh, rows[1]], other) == sequence_seconds([fresh, rows[1]], *other)
