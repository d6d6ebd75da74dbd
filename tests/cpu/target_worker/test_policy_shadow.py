"""Shadow drafts (`target_worker.policy_shadow`): greedy sequences the policy turned off are
asked for a short draft that is scored in hindsight against what they commit, never verified."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from outrider.draft_worker import build_proposer
from outrider.proto import CandidateTree, DraftSampling, TreeBudget
from outrider.target_worker.draft_source import InProcessDraftSource
from outrider.target_worker.engine import Engine
from outrider.target_worker.policy_shadow import SHADOW_TRIAL
from outrider.target_worker.runner import ModelRunner
from outrider.target_worker.sequence import RequestParams
from outrider.target_worker.spec_policy import PolicyConfig, SpeculationPolicy

CEILING = TreeBudget(max_nodes=9, max_depth=8, top_k=1)


def chain(seq_id: int, round: int, root: int, drafts: list[int]) -> CandidateTree:
    return CandidateTree(
        seq_id=seq_id,
        round=round,
        tokens=torch.tensor([root, *drafts], dtype=torch.int64),
        parents=torch.arange(-1, len(drafts), dtype=torch.int64),
        q_nodes=torch.empty(0, dtype=torch.int64),
        q_token_ids=torch.empty(0, 0, dtype=torch.int64),
        q_probs=torch.empty(0, 0, dtype=torch.float32),
        sampling=DraftSampling.DETERMINISTIC,
    )


def shadowing_policy(shadow_cost_s: float = 1e-5) -> SpeculationPolicy:
    """A policy past its warm-up, with probes measured: a probe costs 1 plain-equivalent
    token, one in four finds a stretch that pays 2 a round, sequences live 128 tokens; the
    verify line is 2 ms a round, a drafter's answer `shadow_cost_s`."""
    policy = SpeculationPolicy(CEILING, PolicyConfig())
    policy.rounds = 1000
    policy._probe_extra = 1.0
    policy.forget(-1, tokens=128)
    for gain in (-1.0, -1.0, -1.0, 2.0):
        policy._note_probe(True, gain, 2.0)
    policy._note_find(True)
    for _ in range(20):
        policy.verify_cost.add((1, 0, 0, 1), 2e-3)
        policy.verify_cost.add((9, 1, 1, 1), 2.4e-3)
        policy.draft_cost.add((8, 0, 8), shadow_cost_s)
        policy.draft_cost.add((1, 0, 1), shadow_cost_s)
    policy.verify_cost.solve()
    policy.draft_cost.solve()
    for _ in range(200):  # drafts are lost: the solver turns sequences off
        for kind in (True, False):
            policy.glob[kind].add(2, 2, 0, policy.config.global_decay)
    # No off probe or probe comes unless a test asks (neither is shadowed alongside).
    policy._next_probe = 10**9
    for num_seqs in (1, 2):
        policy.check.select(num_seqs).next_off = 10**9
    policy._draft_octaves.update((1, 2))  # (a batch size never drafted at is probed at once)
    return policy


def off_for_good(policy: SpeculationPolicy) -> None:
    """The last solve turned every sequence off, and no solve or probe comes in the test."""
    policy.budgets([1], [CEILING], 0, greedy=[True])  # (solves once)
    policy._solved = (0, policy._solved[1])
    policy._next_solve = policy._next_probe = 10**9
    policy._draft_octaves.add(1)  # (a batch size never drafted at would be probed at once)
    policy._shadows.clear()


def test_an_off_greedy_sequence_is_shadowed_where_that_costs_less_than_probing_loses():
    policy = shadowing_policy()
    assert policy._probe_loss(True) > 0
    budgets = policy.budgets([1, 2], [CEILING, CEILING], 0, greedy=[True, False])
    # Turned off (nothing known says drafts pay here): the greedy one is shadowed, 2 tokens deep.
    assert policy.stats.depth_counts[0] == 2
    assert policy.shadowed == {1}
    assert budgets[0].max_depth == policy.config.shadow_depth and budgets[1].max_depth == 0


@pytest.mark.parametrize("wait_s,shadowed", [(1e-5, True), (5e-3, False)])
def test_shadows_are_tried_then_kept_only_where_their_measured_rounds_cost_less(wait_s, shadowed):
    """Unmeasured, shadows are tried; after `SHADOW_TRIAL` rounds that asked only shadows, what
    those rounds cost beyond verify(B) decides: a drafter whose answer costs 2.5 plain rounds
    is not asked again, a lookup whose answer costs next to nothing is."""
    policy = shadowing_policy(shadow_cost_s=wait_s)
    off_for_good(policy)
    seq = SimpleNamespace(seq_id=1, tokens=[5, 6, 7], budget=None)
    for round in range(SHADOW_TRIAL):
        policy.budgets([1], [CEILING], 0, greedy=[True])
        assert policy.shadowed == {1}, round  # tried
        policy.shadow_trees([seq], [chain(1, round, 7, [8, 9])], round)
        seq.tokens.append(3)  # the shadow is lost (settled): the next round may ask again
        policy._shadow_round([seq], wait_s, 2e-3, False)
    policy.budgets([1], [CEILING], 0, greedy=[True])
    assert (policy.shadowed == {1}) is shadowed
    assert policy._shadow_s == pytest.approx(wait_s, rel=0.1, abs=2e-5)


def test_shadows_are_not_tried_for_good_where_no_round_measures_them_alone():
    """Rounds that ask shadows beside a prompt chunk (or drafts) do not price them: after
    4 x `SHADOW_TRIAL` such rounds, unmeasured shadows are asked no more."""
    policy = shadowing_policy()
    off_for_good(policy)
    seq = SimpleNamespace(seq_id=1, tokens=[5, 6, 7], budget=None)
    asked = 0
    for round in range(8 * SHADOW_TRIAL):
        policy.budgets([1], [CEILING], 0, greedy=[True])
        asked += policy.shadowed == {1}
        policy.shadow_trees([seq], [chain(1, round, 7, [8, 9])], round)
        seq.tokens.append(3)
        policy._shadow_round([seq], 1e-5, 2e-3, True)  # a prompt chunk in every round
    assert asked == 4 * SHADOW_TRIAL and policy._shadow_rounds == 0


def test_a_shadow_is_priced_by_its_measured_round_not_the_verify_fits_ask_term():
    """Every asked sequence drafts, so the verify fit's per-asked and per-drafted terms move
    together and may split their sum either way: pricing shadows by the per-asked one kept
    them off where their rounds, measured, cost 10 us beyond verify(B)."""
    policy = shadowing_policy()
    for _ in range(20):  # drafting rounds at 1 ms more, all of it fittable as `ask`
        policy.verify_cost.add((1, 1, 1, 1), 3e-3)
    policy.verify_cost.solve()
    off_for_good(policy)
    seq = SimpleNamespace(seq_id=1, tokens=[5, 6, 7], budget=None)
    for round in range(SHADOW_TRIAL):
        policy.budgets([1], [CEILING], 0, greedy=[True])
        policy.shadow_trees([seq], [chain(1, round, 7, [8, 9])], round)
        seq.tokens.append(3)
        policy._shadow_round([seq], 1e-5, 2e-3, False)
    policy.budgets([1], [CEILING], 0, greedy=[True])
    assert policy.shadowed == {1}


def test_fixed_budgets_are_never_shadowed():
    policy = SpeculationPolicy(CEILING, PolicyConfig(adaptive=False))
    policy.budgets([1], [CEILING], 0, greedy=[True])
    assert policy.shadowed == set()


def test_a_shadow_is_verified_root_only_and_scored_once_its_tokens_are_committed():
    policy = shadowing_policy()
    seq = SimpleNamespace(seq_id=1, tokens=[5, 6, 7], budget=None)
    policy.budgets([1], [CEILING], 0, greedy=[True])
    assert policy.shadowed == {1}
    (tree,) = policy.shadow_trees([seq], [chain(1, 9, 7, [8, 9])], round=9)
    assert tree.num_nodes == 1 and int(tree.tokens[0]) == 7  # nothing of it is verified
    before = policy.seqs.get(1)
    assert before is None

    seq.tokens.append(8)  # the round commits the shadow's first token: not settled yet
    policy._shadow_round([seq], 0.0, 2e-3, False)
    assert 1 not in policy.seqs and policy.stats.shadow_drafts == 0

    policy._next_solve = policy.rounds + 100
    seq.tokens.append(9)  # and its second: both kept
    policy._shadow_round([seq], 0.0, 2e-3, False)
    assert policy.stats.shadow_drafts == 1 and policy.stats.shadow_kept == 2
    own = policy.seqs[1]
    assert own._sums[3][:2] == own._sums[0][:2]  # kept at depths 1 and 2, as tried
    assert policy._next_solve == policy.rounds  # a kept shadow asks for a solve at once


def test_a_shadow_lost_at_its_first_token_is_settled_at_once():
    policy = shadowing_policy()
    seq = SimpleNamespace(seq_id=1, tokens=[5, 6, 7], budget=None)
    policy.budgets([1], [CEILING], 0, greedy=[True])
    policy.shadow_trees([seq], [chain(1, 9, 7, [8, 9])], round=9)
    seq.tokens.append(3)
    next_solve = policy._next_solve
    policy._shadow_round([seq], 0.0, 2e-3, False)
    assert policy.stats.shadow_drafts == 1 and policy.stats.shadow_kept == 0
    assert policy._next_solve == next_solve


def test_a_sequence_that_starts_to_loop_is_turned_on_within_a_few_rounds():
    """A greedy sequence whose drafts are lost until round 60 and kept after (its text starts
    to loop), with probes spaced far apart: shadows find the loop, drafting resumes within the
    rounds a 2-token shadow takes to settle and a solve."""
    policy = shadowing_policy()
    policy._next_probe = 10**9  # no probe comes in this test
    rng = random.Random(0)
    truth = [rng.randrange(100) for _ in range(400)]
    seq = SimpleNamespace(seq_id=1, tokens=truth[:10], budget=None)
    depth, on_at, trace = 0, None, []
    for round in range(120):
        looping = round >= 60
        if seq.seq_id in policy.shadowed or depth:
            k = depth or policy.config.shadow_depth
            at = len(seq.tokens)
            drafts = truth[at : at + k] if looping else [t + 100 for t in truth[at : at + k]]
            tree = chain(1, round, seq.tokens[-1], drafts)
        else:
            tree = chain(1, round, seq.tokens[-1], [])
        (tree,) = policy.shadow_trees([seq], [tree], round)
        kept = 0
        drafted = tree.tokens.tolist()[1:]
        while kept < len(drafted) and drafted[kept] == truth[len(seq.tokens) + kept]:
            kept += 1
        seq.tokens += truth[len(seq.tokens) : len(seq.tokens) + kept + 1]
        result = SimpleNamespace(num_output_tokens=torch.tensor([kept + 1]))
        round_s = 2e-3 + (4e-4 if drafted else 0.0)
        policy.observe_round([seq], [tree], result, SimpleNamespace(num_prefill_tokens=0), 1e-5, round_s)
        (budget,) = policy.budgets([1], [CEILING], 0, greedy=[True])
        seq.budget = budget
        depth = 0 if 1 in policy.shadowed else budget.max_depth
        trace.append(depth)
        if round >= 60 and depth and on_at is None:
            on_at = round
    assert sum(k > 0 for k in trace[30:60]) <= 3, trace  # off where drafts are lost
    assert on_at is not None and on_at <= 64, trace
    assert policy.stats.shadow_drafts > 0


@pytest.fixture(scope="module")
def runner(tiny_family):
    return ModelRunner.from_pretrained(tiny_family.target_dir, max_model_len=128, kv_cache_rows=2048)


def test_shadowed_greedy_decoding_equals_plain_and_verifies_no_draft(runner, tokenizer):
    """Every sequence off and shadowed every round it may be: the output is plain greedy
    decoding's, and no draft token reaches verification."""
    texts = ["def read_config(path):\n    with open(path) as f:\n", "for i in range(10):\n    print(i)\n"]
    prompts = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    params = RequestParams(max_tokens=32)
    plain = Engine(runner, None, eos_token_id=None, max_batch=2).generate(prompts, params)
    ngram = build_proposer(
        {"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 3, "num_speculative_tokens": 4},
        vocab_size=runner.model.vocab_size,
    )
    budget = TreeBudget(max_nodes=5, max_depth=4, top_k=1)
    engine = Engine(
        runner, InProcessDraftSource(ngram), eos_token_id=None, max_batch=2, tree_budget=budget,
        budget_policy="adaptive",
    )  # fmt: skip
    policy = engine.policy
    policy._warming_up = lambda: False
    policy._depths = lambda rows, ceiling, prefill_tokens: [0] * len(rows)  # the solver says off
    policy._probed = lambda seq_ids, depths, ceiling, vetoed: depths  # and no probe
    policy._shadow_worth = lambda num_seqs: True
    out = engine.generate(prompts, params)
    assert [c.token_ids for c in out] == [c.token_ids for c in plain]
    assert policy.stats.shadow_drafts > 0 and policy.stats.shadow_kept > 0
    assert engine.stats.spec.num_drafts == 0 and engine.stats.spec.num_draft_tokens == 0


def test_a_round_that_asked_only_shadows_is_no_round_without_drafts_to_the_goodput_check():
    """A shadow's answer is waited for (a draft model at batch 16 over HTTP: ~10 ms on ~10 ms
    rounds), so rounds that asked only shadows measure neither the goodput of rounds without
    drafts nor the timing scale of their forward's size: counted as such, they halved the
    measured goodput of not drafting and the solver drafted 2/3 of the rounds at 0.83x off."""
    policy = shadowing_policy()
    off_for_good(policy)
    seqs = [SimpleNamespace(seq_id=i, tokens=[5, 6, 7], budget=None) for i in (1, 2)]
    ids, ceilings = [1, 2], [CEILING, CEILING]
    for round in range(4):
        policy.budgets(ids, ceilings, 0, greedy=[True, True])
        if round == 0:
            assert policy.shadowed == {1, 2} and policy.check.planned is False
        trees = policy.shadow_trees(seqs, [chain(s.seq_id, round, 7, [8, 9]) for s in seqs], round)
        for s in seqs:
            s.tokens.append(3)
        result = SimpleNamespace(num_output_tokens=torch.tensor([1, 1]))
        plan = SimpleNamespace(num_prefill_tokens=0)
        off_before, timing_before = list(policy.check.off), dict(policy.check._timing)
        policy.observe_round(seqs, trees, result, plan, 10e-3, 10e-3)
        if round == 0:  # a shadow round: not measured as a round without drafts, nor timed
            assert policy.check.off == off_before and policy.check._timing == timing_before


def test_an_off_probe_asks_no_shadow():
    policy = shadowing_policy()
    policy.budgets([1], [CEILING], 0, greedy=[True])
    assert policy.shadowed == {1}
    policy._shadows.clear()
    policy.check.off_probe = True  # as `GoodputCheck.checked` marks an off probe round
    policy._shadow([1], [0], [CEILING.max_depth], 1)
    assert policy.shadowed == set()
