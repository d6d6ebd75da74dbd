"""The proposer interface every drafting method implements, and the registry that names them.

One round for a batch of sequences:

    trees = proposer.propose(updates)     # list[SequenceUpdate] -> list[CandidateTree]

`propose` applies each update's lifecycle to the proposer's per-sequence state and then
drafts for all live sequences at once:

    finished  absorb the last tokens, `retire` the state (e.g. into a cross-request cache), drop it
    reset     drop the state and start again from new_tokens, which is then the whole context
    unknown   a new sequence: new_tokens is its context so far
    otherwise `extend` the state with the delta (new tokens, target features)

A method subclasses `Proposer`, declares its method-specific config keys as an `Options`
dataclass and what it needs from the target as a `FeatureSpec`, and registers under its
vLLM `speculative_config` method name:

    @register_proposer("ngram")
    class NgramProposer(Proposer[NgramState]): ...

    proposer = build_proposer({"method": "ngram", "num_speculative_tokens": 4}, vocab_size=V)

Model-based proposers draft through `tree_builder.build_trees`, which needs one batched
`logits_fn` from them; see that module, and `model_drafting` for what they share.

The speculation cache (`draft_worker.speculation`) drafts from hypothetical extensions of a
sequence's state through a declared protocol (`Speculative`: speculate, adopt, release_state),
which `Proposer` implements by forking states. What it asks of a single draft call (outcome
rows, an interrupt) travels as that call's `DraftHints`, never as attributes on the proposer.
"""

from __future__ import annotations

import abc
import copy
import importlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, Protocol, TypeVar

import torch

from outrider.draft_worker.config import SpeculativeConfig
from outrider.proto import CandidateTree, DraftSampling, FeatureSpec, SequenceUpdate, TreeBudget

StateT = TypeVar("StateT")


@dataclass(frozen=True)
class NoOptions:
    """For methods without keys of their own."""


class SpeculationInterrupted(Exception):
    """A guess (`Proposer.speculate`) was abandoned because a real round is waiting."""


@dataclass(frozen=True)
class DraftHints:
    """What the speculation cache asks of one `propose` / `speculate` call; a method that cannot
    honour a hint ignores it (the cache then probes, or waits for the whole guess)."""

    # Greedy chains also carry q rows that name likely verify outcomes (runner-up tokens, the q
    # after the last draft) at the price of one more draft step, so the cache ranks outcomes
    # without probes.
    outcome_rows: bool = False
    # While speculating: True once a real round is waiting. A method that drafts in steps calls
    # `check_interrupted` between them, so a real round waits for one draft step, not a guess.
    interrupted: Callable[[], bool] | None = None

    def check_interrupted(self) -> None:
        """Between draft steps: raise `SpeculationInterrupted` when a real round is waiting."""
        if self.interrupted is not None and self.interrupted():
            raise SpeculationInterrupted


NO_HINTS = DraftHints()


class Speculative(Protocol[StateT]):
    """What the speculation cache needs from a proposer: trees drafted from hypothetical next
    updates of a sequence, each with the state it was drafted from, without touching the held
    state; then that state installed (a guess came true) or freed (it will never be used)."""

    def speculate(
        self, seq_id: int, updates: Sequence[SequenceUpdate], hints: DraftHints = NO_HINTS
    ) -> list[tuple[CandidateTree, StateT]] | None: ...

    def adopt(self, seq_id: int, state: StateT) -> None: ...

    def release_state(self, state: StateT) -> None: ...

    def retire_changes_shared_state(self) -> bool: ...


class Proposer(abc.ABC, Generic[StateT]):
    method: ClassVar[str] = ""  # set by @register_proposer
    Options: ClassVar[type] = NoOptions  # the method's own config keys, as dataclass fields
    default_num_speculative_tokens: ClassVar[int | None] = None  # None: the key is required
    can_fork: ClassVar[bool] = True  # False: `fork_state` always returns None (no speculation cache)
    # Whether `retire` changes what other sequences draft from (suffix's shared trie), which
    # makes every pre-drafted tree stale (speculation); None = assume so iff `retire` is overridden.
    retire_shares_state: ClassVar[bool | None] = None

    def __init__(
        self,
        config: SpeculativeConfig,
        *,
        vocab_size: int,
        device: torch.device | str = "cpu",
        max_sequences: int = 32,
    ):
        self.config = config
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        # The sequences it is sized to hold state for at once (a model drafter's default KV
        # cache: this many full-length extents); past it a sequence drafts nothing until room frees.
        self.max_sequences = max_sequences
        self._states: dict[int, StateT] = {}

    @property
    def feature_spec(self) -> FeatureSpec:
        """What the target must send with each new token; the default is nothing."""
        return FeatureSpec()

    def feature_projection(self) -> torch.Tensor | None:
        """The fc [H, len(layer_ids) * H] the target applies when `feature_spec.projected`.

        EAGLE-style drafters publish their input projection so the target sends H values per
        token instead of the raw concatenation; their `extend` then receives projected rows.
        None (the default) = this drafter consumes raw features or none.
        """
        return None

    @property
    def num_sequences(self) -> int:
        """Sequences whose draft state is held."""
        return len(self._states)

    def propose(self, updates: Sequence[SequenceUpdate], hints: DraftHints = NO_HINTS) -> list[CandidateTree]:
        """One tree per update that is not `finished`, in the order of `updates`."""
        live: list[SequenceUpdate] = []
        states: list[StateT] = []
        for update in updates:
            if update.finished:
                state = self._states.pop(update.seq_id, None)
                if state is not None:
                    self.extend(state, update)
                    self.retire(state)
                continue
            state = None if update.reset else self._states.get(update.seq_id)
            if state is None:
                state = self.new_state(update)
                self._states[update.seq_id] = state
            self.extend(state, update)
            live.append(update)
            states.append(state)
        return self.draft_with_hints(live, states, hints) if live else []

    # ---- speculation (the `Speculative` protocol): drafting from a hypothetical extension ----

    def fork_state(self, state: StateT) -> StateT | None:
        """An independent copy of `state` to extend and draft from; None = cannot fork (no speculation).

        The default deep-copies, which suits cheap host-side states (ngram, suffix); a method
        whose state holds device memory (a KV cache) overrides this.
        """
        return copy.deepcopy(state)

    def speculate(
        self, seq_id: int, updates: Sequence[SequenceUpdate], hints: DraftHints = NO_HINTS
    ) -> list[tuple[CandidateTree, StateT]] | None:
        """Trees for hypothetical next updates of one sequence, each drafted from a fork of its state.

        The held state is untouched; each returned state is the fork after its update, exactly
        what `propose` would have extended, so `adopt` can install it when the guess comes true.
        None when the sequence is unknown or its state cannot be forked.
        """
        made = self._extended_forks(seq_id, updates)
        if made is None:
            return None
        forks = made[1]
        return list(zip(self.draft_with_hints(updates, forks, hints), forks, strict=True))

    def _extended_forks(
        self, seq_id: int, updates: Sequence[SequenceUpdate]
    ) -> tuple[StateT, list[StateT]] | None:
        """(the held state, one fork per update extended by it); None when any fork fails
        (the forks already made are released) or the sequence is unknown."""
        base = self._states.get(seq_id)
        if base is None or not updates:
            return None
        forks = []
        for update in updates:
            fork = self.fork_state(base)
            if fork is None:
                for made in forks:
                    self.release_state(made)
                return None
            self.extend(fork, update)
            forks.append(fork)
        return base, forks

    def adopt(self, seq_id: int, state: StateT) -> None:
        """Install a state `speculate` returned as the sequence's real state.

        A method whose states hold device memory frees the replaced state's here.
        """
        self._states[seq_id] = state

    def release_state(self, state: StateT) -> None:  # noqa: B027 - forks of host-side states hold nothing
        """A state `speculate` returned will never be adopted: free what it holds.

        The speculation cache calls this once for every fork it discards; the default does nothing.
        """

    def retire_changes_shared_state(self) -> bool:
        """Whether `retire` changes what other sequences draft from, so that every pre-drafted
        tree goes stale (`retire_shares_state`; unset = iff this class overrides `retire`)."""
        if self.retire_shares_state is not None:
            return self.retire_shares_state
        return type(self).retire is not Proposer.retire

    def budget(self, update: SequenceUpdate) -> TreeBudget:
        """This round's budget, never past the tree shape this drafter was configured for."""
        ours, theirs = self.config.budget, update.budget
        return TreeBudget(
            max_nodes=min(ours.max_nodes, theirs.max_nodes),
            max_depth=min(ours.max_depth, theirs.max_depth),
            top_k=min(ours.top_k, theirs.top_k),
            q_width=min(ours.q_width, theirs.q_width),
        )

    @abc.abstractmethod
    def new_state(self, update: SequenceUpdate) -> StateT:
        """Empty state for a new (or re-synced) sequence; `extend` then absorbs new_tokens."""

    @abc.abstractmethod
    def extend(self, state: StateT, update: SequenceUpdate) -> None:
        """Absorb the update's new tokens (and features) into the sequence's state."""

    def retire(self, state: StateT) -> None:  # noqa: B027 - most methods keep nothing past a sequence
        """Called once when a sequence finishes, before its state is dropped."""

    @abc.abstractmethod
    def draft(self, updates: Sequence[SequenceUpdate], states: Sequence[StateT]) -> list[CandidateTree]:
        """One tree per update, for the whole batch at once; states are already extended."""

    def draft_with_hints(
        self, updates: Sequence[SequenceUpdate], states: Sequence[StateT], hints: DraftHints
    ) -> list[CandidateTree]:
        """`draft`, for a call that carries the speculation cache's hints (`propose`, `speculate`).

        The default ignores them; a method that can honour them (draft_model: outcome rows,
        an interrupt checked between draft steps) overrides this instead.
        """
        return self.draft(updates, states)


def root_only_tree(update: SequenceUpdate) -> CandidateTree:
    """No draft tokens: the target decodes one token for this sequence this round."""
    return CandidateTree(
        seq_id=update.seq_id,
        round=update.round,
        tokens=update.new_tokens[-1:].to(torch.int64).cpu(),
        parents=torch.tensor([-1], dtype=torch.int64),
        q_nodes=torch.empty(0, dtype=torch.int64),
        q_token_ids=torch.empty(0, 0, dtype=torch.int64),
        q_probs=torch.empty(0, 0, dtype=torch.float32),
        sampling=DraftSampling.DETERMINISTIC,
    )


_PROPOSERS: dict[str, type[Proposer]] = {}

P = TypeVar("P", bound=type[Proposer])


def register_proposer(method: str) -> Callable[[P], P]:
    """Class decorator: make a proposer buildable under `method` (vLLM's method name)."""

    def register(cls: P) -> P:
        if method in _PROPOSERS:
            raise ValueError(f"speculative method {method!r} is already registered by {_PROPOSERS[method]}")
        cls.method = method
        _PROPOSERS[method] = cls
        return cls

    return register


def unregister_proposer(method: str) -> None:
    """Forget `method`: for a method registered only for a while (a benchmark's, a test's)."""
    _PROPOSERS.pop(method, None)


# Modules whose import registers a built-in method; loaded the first time the registry is read.
_BUILTIN_MODULES = (
    "outrider.draft_worker.ngram",
    "outrider.draft_worker.suffix_tree",
    "outrider.draft_worker.draft_model",
    "outrider.draft_worker.medusa.proposer",
    "outrider.draft_worker.eagle3",
    "outrider.draft_worker.peagle",
    "outrider.draft_worker.mtp",
)


def _load_builtins() -> None:
    for module in _BUILTIN_MODULES:
        importlib.import_module(module)


def known_methods() -> list[str]:
    _load_builtins()
    return sorted(_PROPOSERS)


def proposer_class(method: object) -> type[Proposer]:
    """The class registered under `method`; ValueError naming the known methods otherwise."""
    _load_builtins()
    if method not in _PROPOSERS:
        raise ValueError(
            f"unknown speculative method {method!r}; known methods: {', '.join(known_methods())}"
        )
    return _PROPOSERS[method]


def build_proposer(
    config: Mapping[str, Any], *, vocab_size: int, device: torch.device | str = "cpu", max_sequences: int = 32
) -> Proposer:
    """A proposer from a vLLM-style speculative config dict (see `draft_worker.config`), sized
    for `max_sequences` live sequences (a co-located drafter: its target's max_num_seqs)."""
    parsed = parse_speculative_config(config)
    return _PROPOSERS[parsed.method](
        parsed, vocab_size=vocab_size, device=device, max_sequences=max_sequences
    )


def parse_speculative_config(config: Mapping[str, Any]) -> SpeculativeConfig:
    """Check a vLLM-style dict against its method's keys without building anything (config edges)."""
    cls = proposer_class(config.get("method"))
    return SpeculativeConfig.from_dict(config, cls.Options, cls.default_num_speculative_tokens)
