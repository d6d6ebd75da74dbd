"""`ngram` prompt lookup and `suffix` trees on hand-built contexts, and on mixed batches."""

import pytest
import torch
from draft_testlib import VOCAB, assert_valid, mixed_updates

from outrider.draft_worker import build_proposer
from outrider.draft_worker.suffix_tree import SuffixTrie
from outrider.proto import DraftSampling, SamplingParams, SequenceUpdate, TreeBudget

CHAIN = TreeBudget(max_nodes=9, max_depth=8, top_k=1)


def lookup(context, k=4, low=1, high=3, budget=CHAIN):
    proposer = build_proposer(
        {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": low, "prompt_lookup_max": high},
        vocab_size=VOCAB,
    )
    update = SequenceUpdate(0, 0, torch.tensor(context), SamplingParams(), budget)
    (tree,) = proposer.propose([update])
    assert_valid([tree], [update])
    return tree.tokens[1:].tolist()


def test_longest_ngram_wins():
    # Last 3 tokens "1 2 3" occur at the start (then 4 5); "3" alone last occurred before 9.
    assert lookup([1, 2, 3, 4, 5, 3, 9, 1, 2, 3], k=2) == [4, 5]
    # With n <= 1 only the 1-gram "3" is searched: its most recent occurrence is followed by 9.
    assert lookup([1, 2, 3, 4, 5, 3, 9, 1, 2, 3], k=2, high=1) == [9, 1]


def test_most_recent_earlier_match():
    assert lookup([7, 1, 2, 5, 6, 1, 2, 8, 9, 1, 2], k=2, low=2, high=2) == [8, 9]


def test_min_ngram_bounds_the_search():
    assert lookup([1, 2, 3, 4, 2, 3], k=2, low=2, high=3) == [4, 2]
    assert lookup([1, 2, 3, 4, 2, 3], k=2, low=3, high=3) == []  # only "4 2 3": never seen before
    assert lookup([5], k=2) == []  # context shorter than any match


def test_draft_length_is_k_capped_by_the_budget():
    context = [1, 2, 3, 4, 5, 6, 7, 1, 2]
    assert lookup(context, k=4) == [3, 4, 5, 6]
    assert lookup(context, k=4, budget=TreeBudget(max_nodes=3, max_depth=8, top_k=1)) == [3, 4]
    assert lookup(context, k=4, budget=TreeBudget(max_nodes=9, max_depth=1, top_k=1)) == [3]
    assert lookup(context, k=4, budget=TreeBudget(max_nodes=9, max_depth=8, top_k=0)) == []


def test_a_repeating_pattern_keeps_its_period_past_the_end():
    assert lookup([4, 1, 2, 1, 2], k=5, low=2, high=2) == [1, 2, 1, 2, 1]


def test_deltas_give_the_same_drafts_as_the_whole_context():
    gen = torch.Generator().manual_seed(0)
    context = torch.randint(4, (60,), generator=gen)
    config = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    stream, whole = build_proposer(config, vocab_size=VOCAB), build_proposer(config, vocab_size=VOCAB)
    stream.propose([SequenceUpdate(0, 0, context[:10], SamplingParams(), CHAIN)])
    for end in range(13, 61, 3):
        (a,) = stream.propose([SequenceUpdate(0, end, context[end - 3 : end], SamplingParams(), CHAIN)])
        (b,) = whole.propose([SequenceUpdate(0, end, context[:end], SamplingParams(), CHAIN, reset=True)])
        assert a.tokens.tolist() == b.tokens.tolist()


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_mixed_batch_gives_valid_trees(method):
    budgets = [TreeBudget(9, 4, 3), TreeBudget(5, 8, 1), TreeBudget(1, 4, 2), TreeBudget(12, 3, 4)] * 3
    samplings = [SamplingParams(), SamplingParams(temperature=0.8, top_p=0.9, seed=1)] * 6
    config = {"method": method, "num_speculative_tokens": 6, "tree_top_k": 4, "tree_max_nodes": 16}
    if method == "ngram":
        config |= {"prompt_lookup_min": 1, "prompt_lookup_max": 3}
    proposer = build_proposer(config, vocab_size=VOCAB)
    # Contexts over 3 tokens repeat, so most sequences find matches.
    updates = [
        SequenceUpdate(u.seq_id, 0, u.new_tokens % 3, u.sampling, u.budget)
        for u in mixed_updates(budgets, samplings)
    ]
    for round in range(3):
        trees = proposer.propose(updates)
        assert_valid(trees, updates)
        assert all(t.sampling == DraftSampling.DETERMINISTIC for t in trees)
        assert sum(t.num_nodes > 1 for t in trees) >= 6
        updates = [
            SequenceUpdate(u.seq_id, round + 1, torch.tensor([round % 3]), u.sampling, u.budget)
            for u in updates
        ]


def suffix_tree(context, budget=None, **options):
    config = {
        "method": "suffix",
        "num_speculative_tokens": 8,
        "tree_top_k": 3,
        "tree_max_nodes": 8,
        **options,
    }
    proposer = build_proposer(config, vocab_size=VOCAB)
    update = SequenceUpdate(0, 0, torch.tensor(context), SamplingParams(), budget or TreeBudget(8, 4, 3))
    (tree,) = proposer.propose([update])
    assert_valid([tree], [update])
    return proposer, tree


def test_suffix_proposes_most_frequent_continuations_as_a_tree():
    # "1 2" was followed by 3 three times and by 4 once; "1 2 3" by 5 twice and 6 once; "1 2 4" by 7.
    context = [1, 2, 3, 5, 1, 2, 3, 5, 1, 2, 4, 7, 1, 2, 3, 6, 0, 1, 2]
    shallow = TreeBudget(max_nodes=8, max_depth=2, top_k=3)
    _, tree = suffix_tree(
        context, shallow, suffix_decoding_min_token_prob=0.2, suffix_decoding_max_spec_factor=3.0
    )
    # Best first: 3 (.75), 5 (.5), 4 (.25), 6 (.25), 4 -> 7 (.25); depth 2 stops 5 -> 1.
    assert tree.tokens.tolist() == [2, 3, 5, 4, 6, 7]
    assert tree.parents.tolist() == [-1, 0, 1, 0, 1, 3]
    assert tree.q_nodes.tolist() == [0, 1, 3]
    assert tree.q_token_ids.tolist() == [[3, 4], [5, 6], [7, -1]]  # as wide as the widest row
    expected_q = torch.tensor([[0.75, 0.25], [2 / 3, 1 / 3], [1.0, 0.0]])
    torch.testing.assert_close(tree.q_probs, expected_q)


def test_suffix_min_prob_and_spec_factor_prune():
    context = [1, 2, 3, 5, 1, 2, 3, 5, 1, 2, 4, 7, 1, 2, 3, 6, 0, 1, 2]
    shallow = TreeBudget(max_nodes=8, max_depth=2, top_k=3)
    _, tree = suffix_tree(
        context, shallow, suffix_decoding_min_token_prob=0.4, suffix_decoding_max_spec_factor=3.0
    )
    assert tree.tokens.tolist() == [2, 3, 5]  # 4 (0.25) and 3 -> 6 (0.25) fall below 0.4
    _, tree = suffix_tree(context, suffix_decoding_min_token_prob=0.0, suffix_decoding_max_spec_factor=0.5)
    assert tree.num_nodes == 2  # match "1 2" (length 2) * 0.5 = one draft token
    _, tree = suffix_tree(context, suffix_decoding_min_token_prob=0.0)
    assert tree.tokens.tolist() == [2, 3, 5]  # ... and * 1.0 (the default) = two


def test_suffix_cache_carries_patterns_across_requests():
    proposer, _ = suffix_tree([9, 8], suffix_decoding_max_cached_requests=1)
    budget = TreeBudget(8, 4, 3)
    first = SequenceUpdate(1, 0, torch.tensor([5, 6, 7, 1, 2, 3]), SamplingParams(), budget)
    proposer.propose([first])
    proposer.propose([SequenceUpdate(1, 1, torch.tensor([4]), SamplingParams(), budget, finished=True)])
    (tree,) = proposer.propose([SequenceUpdate(2, 0, torch.tensor([0, 6, 7]), SamplingParams(), budget)])
    assert tree.tokens.tolist()[:3] == [7, 1, 2]  # learnt from sequence 1, never seen by sequence 2
    # A second finished request evicts the first from the one-request cache.
    proposer.propose([SequenceUpdate(3, 0, torch.tensor([0, 0]), SamplingParams(), budget)])
    proposer.propose([SequenceUpdate(3, 1, torch.tensor([0]), SamplingParams(), budget, finished=True)])
    (tree,) = proposer.propose([SequenceUpdate(4, 0, torch.tensor([0, 6, 7]), SamplingParams(), budget)])
    assert tree.num_nodes == 1


def test_trie_remove_undoes_add():
    trie = SuffixTrie(max_depth=4)
    trie.add_stream([1, 2, 3, 1, 2])
    trie.add_stream([2, 3, 4])
    trie.remove_stream([1, 2, 3, 1, 2])
    reference = SuffixTrie(max_depth=4)
    reference.add_stream([2, 3, 4])

    def dump(trie, node=0, path=()):
        return {path: trie.count[node]} | {
            k: v for t, c in trie.children[node].items() for k, v in dump(trie, c, (*path, t)).items()
        }

    assert dump(trie) == dump(reference)
    # Removed substrings' nodes are reused, not leaked.
    size = len(trie.count)
    trie.add_stream([1, 2, 3, 1, 2])
    assert len(trie.count) == size
