"""SpecCache: per-sequence pre-drafted trees for the next round (package docstring: the idea).

    schedule(update r, tree r)   a real round was answered: queue a job for its outcomes
    run_one()                    idle time: rank one job's outcomes once, draft them best first
    lookup(update r+1)           the real delta: a cached tree (its fork adopted), or None

The cache drives its proposer only through the `Speculative` protocol (speculate, adopt,
release_state) and passes what one call needs as `DraftHints`; `draft_hints` also tells the
server which hints its real rounds should carry (outcome rows, except while gated).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any

from outrider.draft_worker.proposer import DraftHints, Proposer, SpeculationInterrupted, Speculative
from outrider.draft_worker.speculation.acceptance import AcceptanceModel
from outrider.draft_worker.speculation.outcomes import Outcome, next_round_update, rank_outcomes
from outrider.proto import CandidateTree, SequenceUpdate

# Each guess as soon as it is drafted: (the proposer's seq_id, its hypothetical update, its tree).
PushFn = Callable[[int, SequenceUpdate, CandidateTree], None]


@dataclass(frozen=True)
class SpecCacheConfig:
    max_outcomes: int = 4  # pre-drafted outcomes per sequence and round
    bonus_per_node: int = 2  # bonus-token guesses per end node before the top-M cut
    # Below this rate of guesses that came true *in time* (the target answered the round from
    # the pushed tree: `SequenceUpdate.answered`) among the rounds speculated for, only one
    # round in `probe_every` is speculated for, doubling up to `max_probe_every` while it
    # stays low: guesses that come late (no idle time to finish them, the target's lanes
    # already hide the round trip) or come true rarely only delay real rounds.
    min_hit_rate: float = 0.25
    probe_every: int = 8
    max_probe_every: int = 128


@dataclass
class SpecStats:
    hits: int = 0
    misses: int = 0  # eligible updates (not reset/finished, no features) that found no entry
    saved_s: float = 0.0  # drafting the hits did not do: each hit's share of its speculate() call
    drafting_s: float = 0.0  # all time spent speculating (outcome probes included), hits or not
    interrupted: int = 0  # guesses abandoned mid-draft because a real round was waiting
    gated: int = 0  # rounds not speculated for while the hit rate was below min_hit_rate


@dataclass
class _Entry:
    update: SequenceUpdate  # the hypothetical update that was drafted
    tree: CandidateTree
    state: Any
    cost_s: float


@dataclass
class _Job:
    update: SequenceUpdate  # round r's update and the tree that answered it
    tree: CandidateTree
    outcomes: list[Outcome] | None = None  # ranked once, then drafted best first; None = not yet


_HIT_RATE_EMA = 0.1  # weight of the newest tried round in the hit rate
_MIN_TRIED = 20  # tried rounds before the hit rate can gate speculation
_COST_EMA = 0.3  # weight of the newest outcome in its drafting cost


def supports_speculation(proposer: Any) -> bool:
    """Whether the proposer has the fork API (test doubles and wrappers may not)."""
    return isinstance(proposer, Proposer) and proposer.can_fork and not proposer.feature_spec.needs_features


class SpecCache:
    """Per-sequence pre-drafted trees for the next round; drafting-thread only."""

    def __init__(self, proposer: Speculative, config: SpecCacheConfig):
        self.proposer, self.config = proposer, config
        self.stats = SpecStats()
        self._entries: dict[int, dict[tuple[int, ...], _Entry]] = {}  # seq_id -> delta -> entry
        self._jobs: dict[int, _Job] = {}  # seq_id -> round r's pair, in the order they are run
        self._sent: dict[int, CandidateTree] = {}  # seq_id -> the tree its next delta answers
        self.acceptance = AcceptanceModel()
        self.outcome_cost_s: float | None = None  # running average of one outcome's drafting
        # Hit rate of the rounds speculation was tried for (EMA; `_tried` = their seq_ids): a
        # round never tried says nothing about whether trying pays.
        self.hit_rate, self._tried_count = 1.0, 0
        self._tried: set[int] = set()
        self._since_probe, self._probe_every = 0, config.probe_every
        self._retire_shares = proposer.retire_changes_shared_state()

    def draft_hints(self, interrupted: Callable[[], bool] | None = None) -> DraftHints:
        """The hints for a draft call now. Outcome rows are asked for except while gated: most
        rounds are then never guessed for, and their extra draft step would only slow real
        drafting (a probe round ranks its outcomes by drafting)."""
        return DraftHints(outcome_rows=not self.gated(), interrupted=interrupted)

    def entries(self, seq_id: int) -> dict[tuple[int, ...], CandidateTree]:
        """{delta: pre-drafted tree} held for the sequence's next round."""
        return {delta: entry.tree for delta, entry in self._entries.get(seq_id, {}).items()}

    # ---- the real rounds -------------------------------------------------------------------

    def lookup(self, update: SequenceUpdate) -> CandidateTree | None:
        """The cached tree for this real update (its state adopted), or None; counts hit or miss."""
        self._jobs.pop(update.seq_id, None)
        sent = self._sent.pop(update.seq_id, None)
        if sent is not None and not (update.finished or update.reset):
            self.acceptance.observe(sent, update.new_tokens.tolist(), update.seq_id)
        entries = self._entries.pop(update.seq_id, {})
        entry = None
        if not (update.finished or update.reset or update.features is not None):
            entry = entries.get(tuple(update.new_tokens.tolist()))
            if entry is not None and (
                entry.update.budget != update.budget or entry.update.sampling != update.sampling
            ):
                entry = None
            if entry is None:
                self.stats.misses += 1
            if update.seq_id in self._tried:
                self._tried_count += 1
                in_time = entry is not None and update.answered
                self.hit_rate += _HIT_RATE_EMA * (float(in_time) - self.hit_rate)
        self._tried.discard(update.seq_id)
        self._release(e for e in entries.values() if e is not entry)
        if entry is None:
            return None
        self.proposer.adopt(update.seq_id, entry.state)
        self.stats.hits += 1
        self.stats.saved_s += entry.cost_s
        return replace(entry.tree, round=update.round)

    def schedule(self, update: SequenceUpdate, tree: CandidateTree) -> None:
        """Round `update.round` was answered with `tree`: pre-draft the next round when idle."""
        if not update.finished and update.features is None and tree.num_nodes > 1:
            self._sent[update.seq_id] = tree
            if not self.gated():
                self._probe_every = self.config.probe_every
            else:
                self._since_probe += 1
                if self._since_probe < self._probe_every:
                    self.stats.gated += 1
                    return
                self._since_probe = 0
                self._probe_every = min(2 * self._probe_every, self.config.max_probe_every)
            self._jobs[update.seq_id] = _Job(update, tree)

    def gated(self) -> bool:
        """Whether guesses have been coming true too rarely to be worth drafting (config)."""
        return self._tried_count >= _MIN_TRIED and self.hit_rate < self.config.min_hit_rate

    def forget(self, seq_id: int) -> None:
        self._jobs.pop(seq_id, None)
        self._sent.pop(seq_id, None)
        self._tried.discard(seq_id)
        self.acceptance.forget(seq_id)
        self._release(self._entries.pop(seq_id, {}).values())

    def retired(self) -> None:
        """A sequence was retired: entries drafted before a shared-state change are stale."""
        if self._retire_shares:
            for entries in self._entries.values():
                self._release(entries.values())
            self._entries.clear()

    def _release(self, entries: Iterable[_Entry]) -> None:
        """Entries that will never be adopted give back what their states hold."""
        for entry in entries:
            self.proposer.release_state(entry.state)

    # ---- idle time -------------------------------------------------------------------------

    def has_work(self) -> bool:
        return bool(self._jobs)

    def run_one(
        self,
        max_outcomes: int | None = None,
        keep_going: Callable[[], bool] = lambda: True,
        push: PushFn | None = None,
        interrupted: Callable[[], bool] | None = None,
    ) -> int:
        """Speculate for the first scheduled sequence; returns its seq_id.

        Its outcomes are ranked once and drafted one at a time, best first, each tree handed
        to `push` as soon as it exists; this call drafts at most `max_outcomes` (default: all
        the config allows) and stops early when `keep_going()` turns False (the next outcome
        would not fit, a real round arrived, or another sequence waits for its turn: a job
        with outcomes left goes to the back of the queue, so every sequence's likeliest guess
        comes before anyone's second). `interrupted()` True (a real round is waiting)
        abandons the outcome being drafted at the proposer's next draft step
        (`DraftHints.interrupted`): a real round waits for one draft step, not a whole guess.
        """
        seq_id = next(iter(self._jobs))
        job = self._jobs.pop(seq_id)
        self._tried.add(seq_id)
        started = time.perf_counter()
        drafted, requeue = 0, True
        hints = self.draft_hints(interrupted)
        if job.outcomes is None:
            self._release(self._entries.pop(seq_id, {}).values())
            try:  # ranking may draft probes (a tree without outcome rows): interruptible too
                job.outcomes = self.outcomes(job.update, job.tree, hints)
            except SpeculationInterrupted:
                self.stats.interrupted += 1  # ranked again on its next turn
        entries = self._entries.setdefault(seq_id, {})
        while job.outcomes and (max_outcomes is None or drafted < max_outcomes):
            if drafted and not keep_going():
                break
            outcome = job.outcomes.pop(0)
            done = self._draft_outcome(seq_id, job.update, outcome, entries, push, hints)
            if done is None:  # interrupted: the outcome waits for its turn again
                job.outcomes.insert(0, outcome)
                break
            if not done:  # the sequence cannot be forked: nothing more to guess
                requeue = False
                break
            drafted += 1
        if requeue and (job.outcomes is None or job.outcomes):
            self._jobs[seq_id] = job
        self.stats.drafting_s += time.perf_counter() - started
        return seq_id

    def _draft_outcome(
        self,
        seq_id: int,
        update: SequenceUpdate,
        outcome: Outcome,
        entries: dict[tuple[int, ...], _Entry],
        push: PushFn | None,
        hints: DraftHints,
    ) -> bool | None:
        """Draft one outcome into `entries` and push it; False when the sequence cannot be
        forked, None when a real round interrupted the drafting."""
        guess = next_round_update(update, outcome.delta)
        drafting = time.perf_counter()
        try:
            drafted = self.proposer.speculate(seq_id, [guess], hints)  # fork + extend + draft
        except SpeculationInterrupted:
            self.stats.interrupted += 1
            return None
        cost = time.perf_counter() - drafting
        if not drafted:
            return False
        ((guessed_tree, state),) = drafted
        entries[outcome.delta] = _Entry(guess, guessed_tree, state, cost)
        ema = self.outcome_cost_s
        self.outcome_cost_s = cost if ema is None else ema + _COST_EMA * (cost - ema)
        if push is not None:
            push(seq_id, guess, guessed_tree)
        return True

    def outcomes(
        self, update: SequenceUpdate, tree: CandidateTree, hints: DraftHints | None = None
    ) -> list[Outcome]:
        """The `max_outcomes` most likely (accepted path, bonus token) pairs, best first."""
        return rank_outcomes(
            update,
            tree,
            self.acceptance,
            self.proposer,
            max_outcomes=self.config.max_outcomes,
            bonus_per_node=self.config.bonus_per_node,
            hints=self.draft_hints() if hints is None else hints,
        )
