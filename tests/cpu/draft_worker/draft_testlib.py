"""A toy model-based proposer and batch builders shared by the draft-worker tests.

`BigramProposer` drafts through the EAGLE-2 tree builder with a fixed random bigram table
(the next token's logits depend only on the last token), so the exact q behind every node
is known: softmax(table[parent token]) after the sequence's sampling params.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from outrider.draft_worker import Frontier, Proposer, build_trees, draft_generator, register_proposer
from outrider.proto import CandidateTree, SamplingParams, SequenceUpdate, TreeBudget, check_trees

VOCAB = 12


def bigram_table(vocab: int = VOCAB, seed: int = 0, scale: float = 2.0) -> torch.Tensor:
    """[vocab, vocab] logits of the next token given the last."""
    return torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(seed)) * scale


@dataclass(frozen=True)
class BigramOptions:
    table_seed: int = 0


@dataclass
class BigramState:
    generator: torch.Generator | None
    calls: int = 0


@register_proposer("test_bigram")
class BigramProposer(Proposer[BigramState]):
    """Model-based in shape: one batched logits call per depth for the whole batch."""

    Options = BigramOptions

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.table = bigram_table(self.vocab_size, self.config.options.table_seed)
        self.frontiers: list[Frontier] = []  # every logits_fn call of the last round, for tests

    def new_state(self, update: SequenceUpdate) -> BigramState:
        return BigramState(draft_generator(update.sampling.seed))

    def extend(self, state: BigramState, update: SequenceUpdate) -> None:
        state.calls += 1

    def draft(self, updates: Sequence[SequenceUpdate], states: Sequence[BigramState]) -> list[CandidateTree]:
        self.frontiers = []

        def logits_fn(frontier: Frontier) -> torch.Tensor:
            self.frontiers.append(frontier)
            return self.table[frontier.tokens]

        roots = torch.stack([u.new_tokens[-1] for u in updates])
        return build_trees(
            updates,
            [self.budget(u) for u in updates],
            self.table[roots],
            logits_fn,
            sampled_mode=self.config.sampled_mode,
            generators=[s.generator for s in states],
        )


def mixed_updates(
    budgets: Sequence[TreeBudget],
    samplings: Sequence[SamplingParams],
    vocab: int = VOCAB,
    seed: int = 0,
    round: int = 0,
) -> list[SequenceUpdate]:
    """One fresh sequence per budget, contexts of different lengths (1, 4, 7, ...)."""
    gen = torch.Generator().manual_seed(seed)
    return [
        SequenceUpdate(
            seq_id=i,
            round=round,
            new_tokens=torch.randint(vocab, (1 + 3 * i,), generator=gen),
            sampling=sampling,
            budget=budget,
        )
        for i, (budget, sampling) in enumerate(zip(budgets, samplings, strict=True))
    ]


def assert_valid(
    trees: Sequence[CandidateTree], updates: Sequence[SequenceUpdate], vocab: int = VOCAB
) -> None:
    """Every tree answers its update and passes proto validation against its budget."""
    assert [t.seq_id for t in trees] == [u.seq_id for u in updates]
    assert [t.round for t in trees] == [u.round for u in updates]
    for tree, update in zip(trees, updates, strict=True):
        assert int(tree.tokens[0]) == int(update.new_tokens[-1])
    errors = check_trees(trees, [u.budget for u in updates], vocab)
    assert errors == [None] * len(trees), errors


def depths(parents: torch.Tensor) -> list[int]:
    out = [0]
    for p in parents.tolist()[1:]:
        out.append(out[p] + 1)
    return out
