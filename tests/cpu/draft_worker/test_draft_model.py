"""`draft_model` on the tiny demo family: every q row the proposer sends must equal what a plain
forward of the draft LM over that node's path gives, across rounds, resets and batch mixes."""

from __future__ import annotations

import pytest
import torch
from draft_testlib import assert_valid, depths

import outrider.draft_worker.draft_model  # noqa: F401 - registers `draft_model`
from outrider.draft_worker import build_proposer
from outrider.draft_worker.draft_model import DraftModelProposer
from outrider.draft_worker.model_drafting import draft_vocabulary
from outrider.kernels import process_logits
from outrider.proto import CandidateTree, SamplingParams, SequenceUpdate, TreeBudget
from outrider.target_worker.batch import SequenceChunk, build_forward_batch
from outrider.target_worker.runner import ModelRunner

CHAIN = {"num_speculative_tokens": 4}
TREE = {"num_speculative_tokens": 4, "tree_top_k": 3, "tree_max_nodes": 10}
GREEDY = SamplingParams()
SAMPLED = SamplingParams(temperature=0.8, top_k=50, top_p=0.9, seed=7)


@pytest.fixture(scope="module")
def draft_dir(tiny_family):
    return tiny_family.draft_dir


@pytest.fixture(scope="module")
def reference(draft_dir):
    return plain_forward(draft_dir)


def plain_forward(draft_dir):
    """next_logits(tokens) -> [vocab]: a plain prefill of the draft LM over `tokens`."""
    runner = ModelRunner.from_pretrained(draft_dir, max_model_len=256, kv_cache_rows=256)
    start = runner.cache.allocate(0, 256)

    def next_logits(tokens: list[int]) -> torch.Tensor:
        chunk = SequenceChunk(start, 0, torch.tensor(tokens, dtype=torch.int64))
        return runner.forward(build_forward_batch([chunk])).logits[-1]

    return next_logits


def make(draft_dir, shape: dict, vocab: int = 2048, **options) -> DraftModelProposer:
    return build_proposer(
        {"method": "draft_model", "model": str(draft_dir), **shape, **options}, vocab_size=vocab
    )


def update(seq_id, tokens, sampling=GREEDY, budget=None, proposer=None, **flags) -> SequenceUpdate:
    return SequenceUpdate(
        seq_id=seq_id,
        round=flags.pop("round", 0),
        new_tokens=torch.as_tensor(tokens, dtype=torch.int64),
        sampling=sampling,
        budget=budget or proposer.config.budget,
        **flags,
    )


def contexts(count: int, seed: int = 0) -> list[list[int]]:
    """Mixed lengths 5, 12, 19, ... of random ids (the tree shape does not need real text)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(2048, (5 + 7 * i,), generator=gen).tolist() for i in range(count)]


def path_to(tree: CandidateTree, node: int) -> list[int]:
    parents, tokens, path = tree.parents.tolist(), tree.tokens.tolist(), []
    while node > 0:
        path.append(tokens[node])
        node = parents[node]
    return path[::-1]


def assert_q_matches(tree: CandidateTree, context: list[int], sampling: SamplingParams, next_logits) -> None:
    """Each q row is the top-k of the draft's distribution at that node (after `sampling`)."""
    k = tree.q_token_ids.shape[1]
    for node, ids, probs in zip(tree.q_nodes.tolist(), tree.q_token_ids, tree.q_probs, strict=True):
        logits = next_logits(context + path_to(tree, node))[None]
        if sampling.greedy:
            q = logits.softmax(-1)[0]
        else:
            s = sampling
            q = process_logits(
                logits, *(torch.tensor([v]) for v in (s.temperature, s.top_k, s.top_p, s.min_p))
            )[0]
        expect_probs, expect_ids = q.topk(k)
        if not sampling.greedy:
            expect_probs = expect_probs / expect_probs.sum()
            assert set(ids.tolist()) == set(expect_ids.tolist())
            torch.testing.assert_close(probs.sort().values, expect_probs.sort().values, atol=1e-4, rtol=1e-3)
        else:
            assert ids.tolist() == expect_ids.tolist()
            torch.testing.assert_close(probs, expect_probs, atol=1e-4, rtol=1e-3)


@pytest.mark.parametrize("shape", [CHAIN, TREE], ids=["chain", "tree"])
def test_q_rows_match_plain_forward_of_each_path(draft_dir, reference, shape):
    proposer = make(draft_dir, shape)
    ctxs = contexts(4)
    samplings = [GREEDY, SAMPLED, GREEDY, SamplingParams(temperature=1.0, seed=3)]
    updates = [
        update(i, c, s, proposer=proposer) for i, (c, s) in enumerate(zip(ctxs, samplings, strict=True))
    ]
    trees = proposer.propose(updates)
    assert_valid(trees, updates, vocab=2048)
    for tree, ctx, s in zip(trees, ctxs, samplings, strict=True):
        assert max(depths(tree.parents)) <= 4
        if shape is CHAIN:
            assert tree.parents.tolist() == [-1, 0, 1, 2, 3]
        assert_q_matches(tree, ctx, s, reference)


def test_chain_at_t0_is_the_drafts_greedy_continuation(draft_dir, reference):
    proposer = make(draft_dir, CHAIN)
    ctx = contexts(3)[2]
    tree = proposer.propose([update(0, ctx, proposer=proposer)])[0]
    greedy = list(ctx)
    for _ in range(4):
        greedy.append(int(reference(greedy).argmax()))
    assert tree.tokens[1:].tolist() == greedy[len(ctx) :]


def test_one_prefill_and_one_forward_per_depth_for_the_whole_batch(draft_dir):
    proposer = make(draft_dir, TREE)
    updates = [update(i, c, proposer=proposer) for i, c in enumerate(contexts(6))]
    proposer.propose(updates)
    # At most one prefill and one forward per expanded depth (the deepest never is), not per sequence.
    assert 2 <= proposer.forwards <= 1 + 3


def test_rounds_overwrite_stale_rows_and_match_a_fresh_sequence(draft_dir, reference):
    """Round 2 after partial acceptance must draft exactly as a sequence prefilled from scratch."""
    proposer = make(draft_dir, TREE)
    ctxs = contexts(3, seed=1)
    first = proposer.propose([update(i, c, proposer=proposer) for i, c in enumerate(ctxs)])
    # Accept the first child's token on sequence 0, nothing on 1, two levels on 2; then a
    # fresh token (the recovered/bonus one) each.
    deltas = [path_to(first[0], 1) + [11], [12], path_to(first[2], 4)[:2] + [13]]
    second_updates = [update(i, d, proposer=proposer, round=1) for i, d in enumerate(deltas)]
    second = proposer.propose(second_updates)
    assert_valid(second, second_updates, vocab=2048)
    for tree, ctx, delta in zip(second, ctxs, deltas, strict=True):
        assert_q_matches(tree, ctx + delta, GREEDY, reference)
    fresh = make(draft_dir, TREE).propose(
        [update(i, c + d, proposer=proposer) for i, (c, d) in enumerate(zip(ctxs, deltas, strict=True))]
    )
    for a, b in zip(second, fresh, strict=True):
        assert a.tokens.tolist() == b.tokens.tolist() and a.parents.tolist() == b.parents.tolist()


def test_reset_resyncs_and_finished_frees_the_extent(draft_dir, reference):
    proposer = make(draft_dir, CHAIN)
    cache = proposer.runner.cache
    ctx, other = contexts(2, seed=2)
    proposer.propose([update(0, ctx, proposer=proposer)])
    held = cache.free_rows
    tree = proposer.propose([update(0, other, proposer=proposer, reset=True, round=5)])[0]
    assert cache.free_rows == held  # the old extent was released, one new one taken
    assert_q_matches(tree, other, GREEDY, reference)
    assert proposer.propose([update(0, [3], proposer=proposer, finished=True)]) == []
    assert cache.free_rows == cache.total_rows and proposer.num_sequences == 0


def test_full_cache_or_long_context_means_root_only_then_recovers(draft_dir, reference):
    proposer = make(draft_dir, CHAIN, kv_cache_rows=2 * (128 + 4))  # two extents: context + 4 scratch rows
    ctxs = contexts(3, seed=3)
    trees = proposer.propose([update(i, c, proposer=proposer) for i, c in enumerate(ctxs)])
    assert [t.num_nodes for t in trees] == [5, 5, 1]  # the third does not fit: no draft
    proposer.propose([update(0, [1], proposer=proposer, finished=True)])
    tree = proposer.propose([update(2, [9], proposer=proposer, round=1)])[0]
    assert tree.num_nodes == 5  # admitted once room freed: prefilled from its whole context
    assert_q_matches(tree, ctxs[2] + [9], GREEDY, reference)
    # Near the draft's max_model_len (128) the depth shrinks; past it, no drafts at all.
    proposer.propose([update(i, [1], proposer=proposer, finished=True) for i in (1, 2)])
    near = proposer.propose([update(7, list(range(126)), proposer=proposer)])[0]
    assert near.num_nodes == 3
    past = proposer.propose([update(8, list(range(129)), proposer=proposer)])[0]
    assert past.num_nodes == 1


def test_the_default_cache_holds_max_sequences_full_length_ones(draft_dir):
    """Without kv_cache_rows the cache holds `max_sequences` sequences (a co-located drafter:
    its target's max_num_seqs); one more drafts nothing until room frees."""
    config = {"method": "draft_model", "model": str(draft_dir), **CHAIN}
    proposer = build_proposer(config, vocab_size=2048, max_sequences=3)
    trees = proposer.propose([update(i, c, proposer=proposer) for i, c in enumerate(contexts(4, seed=5))])
    assert [t.num_nodes for t in trees] == [5, 5, 5, 1]
    assert build_proposer(config, vocab_size=2048).max_sequences == 32  # a draft server's default


def test_engine_budget_shrinks_the_tree(draft_dir):
    proposer = make(draft_dir, TREE)
    small = TreeBudget(max_nodes=4, max_depth=2, top_k=2)
    tree = proposer.propose([update(0, contexts(1)[0], budget=small)])[0]
    assert tree.num_nodes <= 4 and max(depths(tree.parents)) <= 2 and tree.q_token_ids.shape[1] <= 2


def test_seeded_sampling_is_reproducible_whatever_the_batch(draft_dir):
    ctxs = contexts(3, seed=4)
    alone = make(draft_dir, TREE).propose([update(1, ctxs[1], SAMPLED, budget=make_budget())])[0]
    proposer = make(draft_dir, TREE)
    batch = [
        update(i, c, SAMPLED if i == 1 else SamplingParams(temperature=1.0), proposer=proposer)
        for i, c in enumerate(ctxs)
    ]
    mixed = proposer.propose(batch)[1]
    assert alone.tokens.tolist() == mixed.tokens.tolist()


def make_budget() -> TreeBudget:
    """TREE's own budget (q rows of the default 16 entries), handed over explicitly."""
    from outrider.proto import DEFAULT_Q_WIDTH

    return TreeBudget(max_nodes=10, max_depth=4, top_k=3, q_width=DEFAULT_Q_WIDTH)


def test_a_different_vocabulary_is_refused(draft_dir, tiny_family):
    with pytest.raises(ValueError, match=r"draft: 2048 tokens.*target: 4096 tokens"):
        make(draft_dir, CHAIN, vocab=4096)
    size, fingerprint = draft_vocabulary(draft_dir)
    assert size == 2048 and fingerprint is not None
    make(draft_dir, CHAIN, target_vocab_fingerprint=fingerprint)  # the same tokenizer: accepted
    with pytest.raises(ValueError, match="tokenizer fingerprint 0000000000000000"):
        make(draft_dir, CHAIN, target_vocab_fingerprint="0" * 64)
    with pytest.raises(ValueError, match="'model'"):
        build_proposer({"method": "draft_model", "num_speculative_tokens": 2}, vocab_size=2048)


# ---- speculation: forks borrow the extent --------------------------------------------------


@pytest.mark.parametrize("serial", [False, True], ids=["batched", "serial"])
def test_speculation_takes_no_rows_and_leaks_none_over_many_rounds(draft_dir, serial):
    """Rounds of hits, misses, resets and an eviction past max_model_len with the speculation
    cache on: a miss drafts as if nothing was speculated, and once every sequence finishes
    every KV row is free again. Forks draft batched in scratch extents, or, in a cache with
    room for the four sequences only, one at a time in their sequence's extent."""
    from outrider.draft_worker.speculation import SpecCache, SpecCacheConfig, supports_speculation

    rows_for_four = {"kv_cache_rows": 4 * (128 + 3 * 3)} if serial else {}
    proposer, plain = make(draft_dir, TREE, **rows_for_four), make(draft_dir, TREE)
    scratch, find_scratch = [], proposer._scratch_extents
    proposer._scratch_extents = lambda base, forks: scratch.append(find_scratch(base, forks)) or scratch[-1]
    cache, rows = SpecCache(proposer, SpecCacheConfig(max_outcomes=3)), proposer.runner.cache
    assert supports_speculation(proposer) and rows.free_rows == rows.total_rows
    ctxs = contexts(4, seed=5)
    updates = [update(i, c, proposer=proposer) for i, c in enumerate(ctxs)]
    hints = cache.draft_hints()  # as the server's real rounds carry them
    trees = proposer.propose(updates, hints)
    plain.propose(updates)
    gen = torch.Generator().manual_seed(5)
    for round in range(1, 16):
        free = rows.free_rows
        for u, t in zip(updates, trees, strict=True):
            cache.schedule(u, t)
        while cache.has_work():
            cache.run_one()
        assert rows.free_rows == free  # forks take no rows
        nxt = []
        for i, (u, t) in enumerate(zip(updates, trees, strict=True)):
            guessed = cache.outcomes(u, t)
            if round % 4 and guessed and i != 3:
                delta = list(guessed[0].delta)
            else:  # sequence 3 sends a long delta: it grows past max_model_len (128) and is evicted
                delta = torch.randint(2048, (9 if i == 3 else 2,), generator=gen).tolist()
            nxt.append(update(i, delta, proposer=proposer, round=round, reset=i == 1 and round == 6))
        hits = [cache.lookup(u) for u in nxt]
        missed = [u for u, h in zip(nxt, hits, strict=True) if h is None]
        drafted = iter(proposer.propose(missed, cache.draft_hints()))
        trees = [h if h is not None else next(drafted) for h in hits]
        reference = plain.propose(nxt)  # the same history without speculation drafts the same trees
        for a, b in zip(trees, reference, strict=True):
            assert a.tokens.tolist() == b.tokens.tolist() and a.parents.tolist() == b.parents.tolist()
        updates = nxt
    assert cache.stats.hits >= 10 and cache.stats.misses >= 10, cache.stats
    assert scratch and (None in scratch) == serial  # (serial: until the eviction frees room)
    assert trees[3].num_nodes == 1  # evicted: root-only, its extent freed
    proposer.propose([update(i, [1], proposer=proposer, finished=True) for i in range(4)])
    assert rows.free_rows == rows.total_rows and proposer.num_sequences == 0


def test_a_fork_past_max_model_len_or_without_an_extent_leaves_the_sequence_alone(draft_dir):
    proposer = make(draft_dir, CHAIN, kv_cache_rows=128 + 4)  # room for one sequence
    first, second = proposer.propose(
        [update(0, list(range(120)), proposer=proposer), update(1, [5, 6], proposer=proposer)]
    )
    assert (first.num_nodes, second.num_nodes) == (5, 1)
    assert proposer.speculate(1, [update(1, [7], round=1, proposer=proposer)]) is None  # no extent: no fork
    # A fork that would pass max_model_len drafts nothing and keeps the real state's extent.
    ((tree, fork),) = proposer.speculate(0, [update(0, list(range(9)), round=1, proposer=proposer)])
    assert tree.num_nodes == 1
    proposer.release_state(fork)
    assert proposer.runner.cache.free_rows == 0
    again = proposer.propose([update(0, [3], round=1, proposer=proposer)])[0]
    assert again.num_nodes == 5


def test_outcome_rows_name_the_runner_up_and_the_q_after_the_last_draft(draft_dir, reference):
    """With `outcome_rows` (the speculation cache asks for them) a greedy chain's q rows are the draft's
    top 2 at every node, the leaf included, so the cache ranks outcomes without probing."""
    from outrider.draft_worker.speculation import SpecCache, SpecCacheConfig

    proposer = make(draft_dir, CHAIN)
    cache = SpecCache(proposer, SpecCacheConfig(max_outcomes=4))
    hints = cache.draft_hints()
    assert hints.outcome_rows
    context = contexts(1, seed=9)[0]
    first = update(0, context, proposer=proposer)
    (tree,) = proposer.propose([first], hints)
    assert tree.num_nodes == 5 and tree.q_nodes.tolist() == [0, 1, 2, 3, 4]  # a row at the leaf too
    assert tree.q_token_ids.shape[1] == 2
    assert_q_matches(tree, context, GREEDY, reference)
    assert_valid([tree], [first], 2048)
    probes = []
    speculate = proposer.speculate
    proposer.speculate = lambda *args: probes.append(args) or speculate(*args)
    outcomes = cache.outcomes(first, tree)
    assert not probes  # every node has a row: nothing to draft just to find a bonus token
    leaf_row = tree.q_token_ids[4].tolist()
    full = [o for o in outcomes if len(o.path) == 4]
    assert full and all(o.bonus in leaf_row for o in full)
    assert any(len(o.path) < 4 for o in outcomes)  # runner-ups give partial-acceptance guesses
