"""`replay`: a drafter of known quality, for measuring the engine apart from any model.

It proposes the target's own recorded continuation (greedy outputs recorded beforehand: the
`recording` file, a JSON list of token lists, each prompt + continuation), with each token
replaced by another with probability 1 - `acceptance`. At T = 0 every draft token is then
kept with probability `acceptance`, independently, so the acceptance length of a K-token
chain is (1 - a^(K+1)) / (1 - a) exactly, and drafting costs next to nothing: what a
benchmark measures is how much of that ideal the engine turns into speed, and where the
speculation policy puts its budgets for each a. It lives with the benchmarks and is
registered only while one runs (`registered()`): nothing serves it, and it needs a recording
of the very target it drafts for.

    {"method": "replay", "num_speculative_tokens": 8, "acceptance": 0.7, "recording": "rec.json"}
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from outrider.draft_worker.ngram import chain_tree
from outrider.draft_worker.proposer import Proposer, register_proposer, root_only_tree, unregister_proposer
from outrider.proto import CandidateTree, SequenceUpdate


@dataclass(frozen=True)
class ReplayOptions:
    recording: str | None = None  # JSON list of token lists (prompt + recorded continuation)
    acceptance: float = 0.7  # chance each draft token is the recorded one (kept at T = 0)
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0.0 <= self.acceptance <= 1.0:
            raise ValueError(f"replay: acceptance = {self.acceptance} must be in [0, 1]")
        if self.recording is None:
            raise ValueError("replay: needs `recording`, a JSON file of token lists (prompt + continuation)")


@dataclass
class ReplayState:
    context: list[int] = field(default_factory=list)
    recording: list[int] | None = None  # the recording this context follows, once found


class ReplayProposer(Proposer[ReplayState]):
    Options = ReplayOptions

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        options: ReplayOptions = self.config.options
        self.recordings = [list(map(int, r)) for r in json.loads(Path(options.recording).read_text())]
        self.rng = random.Random(options.seed)

    def new_state(self, update: SequenceUpdate) -> ReplayState:
        return ReplayState()

    def extend(self, state: ReplayState, update: SequenceUpdate) -> None:
        state.context.extend(update.new_tokens.tolist())
        n, rec = len(state.context), state.recording
        if rec is None or rec[:n] != state.context:
            state.recording = next((r for r in self.recordings if r[:n] == state.context), None)

    def draft(self, updates: Sequence[SequenceUpdate], states: Sequence[ReplayState]) -> list[CandidateTree]:
        acceptance, vocab = self.config.options.acceptance, self.vocab_size
        trees = []
        for update, state in zip(updates, states, strict=True):
            budget = self.budget(update)
            length = min(budget.max_depth, budget.max_nodes - 1) if budget.top_k > 0 else 0
            n = len(state.context)
            recorded = state.recording[n : n + length] if state.recording is not None else []
            drafted = [
                t if self.rng.random() < acceptance else (t + 1 + self.rng.randrange(vocab - 1)) % vocab
                for t in recorded
            ]
            trees.append(chain_tree(update, drafted) if drafted else root_only_tree(update))
        return trees


@contextmanager
def registered() -> Iterator[None]:
    """`replay` is a speculative method inside the block, and unknown again after it."""
    register_proposer("replay")(ReplayProposer)
    try:
        yield
    finally:
        unregister_proposer("replay")
