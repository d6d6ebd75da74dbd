"""The registry and vLLM-style config dicts; the per-sequence lifecycle every proposer shares."""

import pytest
import torch
from draft_testlib import VOCAB

from outrider.draft_worker import Proposer, build_proposer, known_methods, register_proposer
from outrider.draft_worker.ngram import NgramProposer
from outrider.draft_worker.suffix_tree import SuffixProposer
from outrider.proto import DraftSampling, FeatureSpec, SamplingParams, SequenceUpdate, TreeBudget


def test_builds_registered_methods_from_vllm_dicts():
    ngram = build_proposer(
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 4},
        vocab_size=VOCAB,
    )
    assert isinstance(ngram, NgramProposer) and ngram.method == "ngram"
    assert (ngram.config.options.prompt_lookup_min, ngram.config.options.prompt_lookup_max) == (2, 4)
    assert ngram.config.budget == TreeBudget(max_nodes=4, max_depth=3, top_k=1, q_width=32)  # a chain of K
    assert ngram.feature_spec == FeatureSpec() and not ngram.feature_spec.needs_features
    suffix = build_proposer({"method": "suffix", "suffix_decoding_min_token_prob": 0.2}, vocab_size=VOCAB)
    assert isinstance(suffix, SuffixProposer) and suffix.config.num_speculative_tokens == 24
    assert {"ngram", "suffix"} <= set(known_methods())


def test_unknown_method_lists_known_ones():
    with pytest.raises(ValueError, match="unknown speculative method 'eagle9'.*ngram.*suffix"):
        build_proposer({"method": "eagle9", "num_speculative_tokens": 3}, vocab_size=VOCAB)


def test_unknown_key_names_accepted_keys():
    with pytest.raises(ValueError, match=r"unknown keys \['prompt_lookup_maximum'\].*prompt_lookup_max"):
        build_proposer(
            {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_maximum": 4}, vocab_size=VOCAB
        )


@pytest.mark.parametrize(
    ("given", "expected"),
    [({}, (5, 5)), ({"prompt_lookup_min": 2}, (2, 2)), ({"prompt_lookup_max": 3}, (3, 3))],
)
def test_prompt_lookup_defaults_follow_vllm(given, expected):
    proposer = build_proposer({"method": "ngram", "num_speculative_tokens": 2, **given}, vocab_size=VOCAB)
    options = proposer.config.options
    assert (options.prompt_lookup_min, options.prompt_lookup_max) == expected


@pytest.mark.parametrize(
    "bad",
    [
        {"method": "ngram"},  # num_speculative_tokens is required
        {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
        {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0},
        {"method": "ngram", "num_speculative_tokens": 0},
        {"method": "ngram", "num_speculative_tokens": 2, "draft_sampling": "sometimes"},
    ],
)
def test_bad_configs_are_refused(bad):
    with pytest.raises(ValueError):
        build_proposer(bad, vocab_size=VOCAB)


def test_tree_keys_set_the_default_budget_and_sampling():
    config = {
        "method": "test_bigram",
        "num_speculative_tokens": 5,
        "tree_top_k": 4,
        "tree_max_nodes": 16,
        "draft_sampling": "with_replacement",
    }
    proposer = build_proposer(config, vocab_size=VOCAB)
    assert proposer.config.budget == TreeBudget(max_nodes=16, max_depth=5, top_k=4, q_width=32)
    assert proposer.config.sampled_mode == DraftSampling.WITH_REPLACEMENT
    # The engine's per-round budget is clamped to the configured shape; q rows to the narrower side.
    update = SequenceUpdate(0, 0, torch.tensor([1]), SamplingParams(), TreeBudget(64, 3, 8))
    assert proposer.budget(update) == TreeBudget(max_nodes=16, max_depth=3, top_k=4, q_width=8)
    wide = SequenceUpdate(0, 0, torch.tensor([1]), SamplingParams(), TreeBudget(64, 3, 8, q_width=64))
    assert proposer.budget(wide).q_width == 32
    with pytest.raises(ValueError, match="tree_q_width"):
        build_proposer({**config, "tree_q_width": 0}, vocab_size=VOCAB)


def test_a_method_registers_once():
    with pytest.raises(ValueError, match="already registered"):
        register_proposer("ngram")(type("Again", (NgramProposer,), {}))


def test_lifecycle_new_extend_reset_finished():
    proposer: Proposer = build_proposer({"method": "ngram", "num_speculative_tokens": 2}, vocab_size=VOCAB)
    budget = TreeBudget(3, 2, 1)

    def update(seq_id, tokens, **flags):
        return SequenceUpdate(seq_id, 0, torch.tensor(tokens), SamplingParams(), budget, **flags)

    trees = proposer.propose([update(1, [1, 2, 3]), update(2, [4, 5])])
    assert [t.seq_id for t in trees] == [1, 2] and proposer.num_sequences == 2
    proposer.propose([update(1, [4])])
    assert proposer._states[1].tokens == [1, 2, 3, 4]
    proposer.propose([update(1, [7, 8], reset=True)])
    assert proposer._states[1].tokens == [7, 8]
    assert proposer.propose([update(2, [], finished=True)]) == []  # no tree for a finished sequence
    assert proposer.num_sequences == 1
