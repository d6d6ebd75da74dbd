"""`ngram`: prompt lookup over the sequence's own context (vLLM's n-gram proposer).

Search for the last n tokens earlier in the context, for n from `prompt_lookup_max` down to
`prompt_lookup_min` (the longest match wins), and propose the K tokens that followed the most
recent earlier occurrence:

    context   a b c d x y a b c e a b c |        last 3 tokens: "a b c"
              ^^^^^         ^^^^^                 occurrences ending before the end
    most recent: "a b c" at 6..8, followed by "e a b c" -> draft [e, a, b, c][:K]

When the match is so recent that its continuation runs into the end of the context (a
repeating pattern of period d < K), the draft keeps copying with that period: position j of
the draft repeats draft position j - d, exactly what the context would hold if the pattern
went on. vLLM stops the draft there instead.

Each sequence keeps, for every n, a dict from n-gram to the end of its most recent earlier
occurrence, updated with each new token; a lookup is then (max - min + 1) dict probes,
independent of the context length. Drafts are deterministic (a point mass, so
DraftSampling.DETERMINISTIC: the verifier needs no q), sent as one-token q rows anyway so
every tree says what it was drawn from.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from outrider.draft_worker.proposer import Proposer, register_proposer, root_only_tree
from outrider.proto import CandidateTree, DraftSampling, SequenceUpdate


@dataclass(frozen=True)
class NgramOptions:
    # vLLM: if only one of the two is set, the other takes its value; if neither, both are 5.
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None

    def __post_init__(self) -> None:
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        if low is None and high is None:
            low = high = 5
        elif low is None:
            low = high
        elif high is None:
            high = low
        if not (isinstance(low, int) and isinstance(high, int) and 1 <= low <= high):
            raise ValueError(
                f"ngram: need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                f"prompt_lookup_min = {self.prompt_lookup_min}, prompt_lookup_max = {self.prompt_lookup_max}"
            )
        object.__setattr__(self, "prompt_lookup_min", low)
        object.__setattr__(self, "prompt_lookup_max", high)


@dataclass
class NgramIndex:
    """A context and, per n-gram size, each n-gram's most recent occurrence that has a successor."""

    min_n: int
    max_n: int
    tokens: list[int] = field(default_factory=list)
    # last_end[n - min_n][gram] = e: tokens[e - n : e] == gram, e < len(tokens), e the largest such.
    last_end: list[dict[tuple[int, ...], int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.last_end = [{} for _ in range(self.min_n, self.max_n + 1)]

    def append(self, new_tokens: Sequence[int]) -> None:
        tokens = self.tokens
        for token in new_tokens:
            # The n-grams ending at the current end now have a successor: `token`.
            end = len(tokens)
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self.last_end[n - self.min_n][tuple(tokens[end - n : end])] = end
            tokens.append(token)

    def lookup(self, num_tokens: int) -> list[int]:
        """Up to `num_tokens` draft tokens continuing the context; [] when nothing matches."""
        tokens, end = self.tokens, len(self.tokens)
        for n in range(min(self.max_n, end), self.min_n - 1, -1):
            start = self.last_end[n - self.min_n].get(tuple(tokens[end - n :]))
            if start is not None:
                # Positions past the end copy the draft itself (period end - start).
                draft: list[int] = []
                for j in range(num_tokens):
                    draft.append(tokens[start + j] if start + j < end else draft[j - (end - start)])
                return draft
        return []


@register_proposer("ngram")
class NgramProposer(Proposer[NgramIndex]):
    Options = NgramOptions

    def new_state(self, update: SequenceUpdate) -> NgramIndex:
        options: NgramOptions = self.config.options
        return NgramIndex(options.prompt_lookup_min, options.prompt_lookup_max)

    def fork_state(self, state: NgramIndex) -> NgramIndex:
        """Shallow copies suffice (keys are tuples, values ints): ~20x cheaper than deepcopy,
        which walked every n-gram key of the context for each speculated outcome."""
        fork = NgramIndex(state.min_n, state.max_n, tokens=list(state.tokens))
        fork.last_end = [dict(grams) for grams in state.last_end]
        return fork

    def extend(self, state: NgramIndex, update: SequenceUpdate) -> None:
        state.append(update.new_tokens.tolist())

    def draft(self, updates: Sequence[SequenceUpdate], states: Sequence[NgramIndex]) -> list[CandidateTree]:
        trees = []
        for update, state in zip(updates, states, strict=True):
            budget = self.budget(update)
            length = min(budget.max_depth, budget.max_nodes - 1) if budget.top_k > 0 else 0
            drafted = state.lookup(length) if length > 0 else []
            trees.append(chain_tree(update, drafted) if drafted else root_only_tree(update))
        return trees


def chain_tree(update: SequenceUpdate, drafted: list[int]) -> CandidateTree:
    """A deterministic chain rooted at the update's last token, each step a point-mass q."""
    num_drafts = len(drafted)
    return CandidateTree(
        seq_id=update.seq_id,
        round=update.round,
        tokens=torch.tensor([int(update.new_tokens[-1]), *drafted], dtype=torch.int64),
        parents=torch.arange(-1, num_drafts, dtype=torch.int64),
        q_nodes=torch.arange(num_drafts, dtype=torch.int64),
        q_token_ids=torch.tensor(drafted, dtype=torch.int64)[:, None],  # [num_drafts, 1]
        q_probs=torch.ones(num_drafts, 1, dtype=torch.float32),
        sampling=DraftSampling.DETERMINISTIC,
    )
