"""The draft server's use of the speculation cache: answer real rounds from it, fill idle
windows with guesses, and push each guess to its target as soon as it is drafted.

    reader threads   round_arrived()            a real round ends the idle window
    drafting thread  answer(batch)              hits: cached trees, their forks adopted
                     drafted(updates, trees)    the rest were drafted: schedule their outcomes
                     batch_done(waiting)        the idle window opens (or was none)
                     has_idle_work()            a job, and time left in the window for it
                     speculate(...)             one sequence's guesses, each pushed at once

A pushed guess (`SpeculativeTree`: the delta it assumes and the tree for it) lets the target
answer the round without a round trip when the delta comes true; the target then says so
(`SequenceUpdate.answered`) and gets no copy of the tree.
"""

from __future__ import annotations

import logging
import queue
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

from outrider.draft_worker.proposer import DraftHints, Speculative
from outrider.draft_worker.speculation.cache import SpecCache, SpecCacheConfig, SpecStats
from outrider.draft_worker.speculation.idle_window import IdleWindow
from outrider.proto import CandidateTree, SequenceUpdate
from outrider.proto import outrider_pb2 as pb

log = logging.getLogger(__name__)

Outbox = queue.SimpleQueue  # of pb.DraftResponse | None: one target stream's responses
# The proposer's seq_id -> (the stream's outbox, the target's seq_id); None = no longer served.
RouteFn = Callable[[int], "tuple[Outbox, int] | None"]


def speculative_response(update: SequenceUpdate, tree: CandidateTree, target_seq_id: int) -> pb.DraftResponse:
    """A pre-drafted tree sent ahead of its round, labelled with the target's seq_id."""
    guess = pb.SpeculativeTree(
        new_tokens=update.new_tokens.tolist(), tree=replace(tree, seq_id=target_seq_id).to_proto()
    )
    return pb.DraftResponse(speculative=[guess])


class Speculator:
    """A SpecCache and its idle window, as the draft batcher drives them."""

    def __init__(self, proposer: Speculative, config: SpecCacheConfig):
        self.cache = SpecCache(proposer, config)
        self.window = IdleWindow()
        self.pushed = 0  # pre-drafted trees sent ahead of their round

    @property
    def stats(self) -> SpecStats:
        return self.cache.stats

    def draft_hints(self) -> DraftHints:
        """What a real round's `propose` should carry (outcome rows, unless gated)."""
        return self.cache.draft_hints()

    # ---- under the batcher's lock ----------------------------------------------------------

    def round_arrived(self) -> None:
        self.window.round_arrived()

    def batch_done(self, rounds_waiting: bool) -> None:
        self.window.batch_done(rounds_waiting)

    def has_idle_work(self) -> bool:
        return self.cache.has_work() and self.outcomes_that_fit() > 0

    # ---- the drafting thread ---------------------------------------------------------------

    def outcomes_that_fit(self) -> int:
        """Outcomes to pre-draft now: as many as should be done before the next real round."""
        return self.window.outcomes_that_fit(self.cache.config.max_outcomes, self.cache.outcome_cost_s)

    def answer(self, batch: Mapping[int, SequenceUpdate]) -> dict[int, CandidateTree]:
        """{seq_id: cached tree} for the batch's updates a guess answers; each hit's round is
        speculated on like a drafted one."""
        if any(u.finished for u in batch.values()):
            self.cache.retired()
        hits = {u.seq_id: self.cache.lookup(u) for u in batch.values()}
        for update in batch.values():
            if hits[update.seq_id] is not None:
                self.cache.schedule(update, hits[update.seq_id])
        return {seq_id: tree for seq_id, tree in hits.items() if tree is not None}

    def drafted(self, updates: Sequence[SequenceUpdate], trees: Sequence[CandidateTree]) -> None:
        """Real rounds were drafted: pre-draft their next rounds when idle."""
        by_id = {u.seq_id: u for u in updates}
        for tree in trees:
            self.cache.schedule(by_id[tree.seq_id], tree)

    def forget(self, seq_id: int) -> None:
        self.cache.forget(seq_id)

    def speculate(self, rounds_waiting: Callable[[], bool], route: RouteFn) -> None:
        """One sequence's speculation, each tree pushed to its target as soon as it is drafted;
        it stops when a real round arrives or the next outcome would not fit the idle window."""

        def push(seq_id: int, update: SequenceUpdate, tree: CandidateTree) -> None:
            target = route(seq_id)
            if target is None:
                return
            outbox, target_seq_id = target
            self.pushed += 1
            outbox.put(speculative_response(update, tree, target_seq_id))

        try:
            self.cache.run_one(
                max_outcomes=max(1, self.outcomes_that_fit()),
                # Breadth first: another sequence's likeliest guess beats this one's next.
                keep_going=lambda: (
                    not (rounds_waiting() or self.cache.has_work()) and self.outcomes_that_fit() > 0
                ),
                push=push,
                interrupted=rounds_waiting,  # a real round came in
            )
        except Exception:  # a failed guess costs only the cache
            log.exception("speculation failed")
