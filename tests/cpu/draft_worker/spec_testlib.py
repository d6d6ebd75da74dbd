"""Shared by the speculation tests: a repetitive context, small budgets, tree comparison."""

from __future__ import annotations

import torch

from outrider.proto import SamplingParams, SequenceUpdate, TreeBudget

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
