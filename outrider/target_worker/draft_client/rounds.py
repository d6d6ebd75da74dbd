"""The open rounds: what each sequence's round awaits, the trees that arrive for it (checked
on arrival, off the engine's thread), and what `collect` hands the engine.

    submit ── open(Awaited) ─┬─ the worker's tree arrives, checked (`receive`) ─┬─> ready ─> collect
                             └─ a pushed tree already answered it (`answer`) ───┘
    collect closes every round it is asked about: a tree arriving after that is late.

Everything that arrives is untrusted: `proto.receive_trees` checks each tree against the
budget its round was asked with and the vocabulary, and its node 0 must be the round's root
(the last token of the update). A bad tree is dropped and counted, never raised; the
sequence decodes unspeculated that round. Every method runs under the client's lock, which
`collect` takes itself (it waits on it for the trees).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from outrider.proto import CandidateTree, TreeBudget, receive_trees
from outrider.proto import outrider_pb2 as pb
from outrider.target_worker.draft_client.config import DraftClientCounters
from outrider.target_worker.draft_client.routing import SyncedSequence
from outrider.target_worker.draft_client.transport import Endpoint

log = logging.getLogger(__name__)


@dataclass
class Awaited:
    round: int
    budget: TreeBudget
    root: int  # the token the tree's node 0 must hold
    endpoint: Endpoint
    delta: tuple[int, ...] = ()  # the update's new tokens, which a pushed tree must have assumed


class Rounds:
    def __init__(
        self,
        cond: threading.Condition,
        sequences: dict[int, SyncedSequence],  # the client's live sequences (read, and their misses)
        counters: DraftClientCounters,
        vocab_size: int,
    ):
        self._cond, self._sequences, self.counters, self.vocab_size = cond, sequences, counters, vocab_size
        self._awaiting: dict[int, Awaited] = {}
        self._ready: dict[int, CandidateTree] = {}

    def awaited(self, seq_id: int) -> Awaited | None:
        return self._awaiting.get(seq_id)

    def open(self, seq_id: int, awaited: Awaited) -> None:
        self._awaiting[seq_id] = awaited

    def drop(self, seq_id: int) -> None:
        """Forget the sequence's round, answered or not: a new update replaces it."""
        self._ready.pop(seq_id, None)
        self._awaiting.pop(seq_id, None)

    def answer(self, seq_id: int, tree: CandidateTree) -> None:
        """A tree already checked answers the awaited round."""
        del self._awaiting[seq_id]
        self._ready[seq_id] = tree
        self._sequences[seq_id].clear_misses()
        self.counters.trees_received += 1
        self._cond.notify_all()

    def collect(self, seq_ids: Sequence[int], timeout_s: float) -> dict[int, CandidateTree]:
        """Trees that arrive within `timeout_s`; then every round asked about is closed."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while any(s in self._awaiting for s in seq_ids):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            trees = {s: self._ready.pop(s) for s in seq_ids if s in self._ready}
            for seq_id in seq_ids:
                # The round is closed: a tree arriving from now on is late.
                awaited = self._awaiting.pop(seq_id, None)
                state = self._sequences.get(seq_id)
                if seq_id in trees or state is None:
                    continue
                self.counters.trees_missing += 1
                if awaited is not None and awaited.endpoint.healthy:
                    state.missed()
        return trees

    def receive(
        self,
        endpoint: Endpoint,
        trees: Sequence[pb.CandidateTree],
        answered_by_push: Callable[[int, int], bool],  # (seq_id, round): its worker's answer is a duplicate
    ) -> None:
        """The worker's answers: those for an open round are checked and made ready."""
        current = []
        for tree in trees:
            awaited = self._awaiting.get(tree.seq_id)
            if awaited is None or awaited.round != tree.round or awaited.endpoint is not endpoint:
                if answered_by_push(tree.seq_id, tree.round):
                    continue
                self.counters.trees_late += 1
                state = self._sequences.get(tree.seq_id)
                if state is not None:
                    state.clear_misses()  # late, but the worker clearly holds the sequence
                continue
            current.append(tree)
        if not current:
            return
        budgets = {tree.seq_id: self._awaiting[tree.seq_id].budget for tree in current}
        checked, errors = receive_trees(pb.DraftResponse(trees=current), budgets, self.vocab_size)
        for error in errors:
            log.debug("draft worker %s: dropped %s", endpoint.address, error)
        self.counters.trees_invalid += len(errors)
        awaited = {seq_id: self._awaiting.pop(seq_id) for seq_id in budgets}  # one answer per round
        for tree in checked:
            if int(tree.tokens[0]) != awaited[tree.seq_id].root:
                self.counters.trees_invalid += 1
                continue
            self.counters.trees_received += 1
            self._ready[tree.seq_id] = tree
            self._sequences[tree.seq_id].clear_misses()
        self._cond.notify_all()

    def forget_endpoint(self, endpoint: Endpoint) -> None:
        """The endpoint's stream is gone: its pending rounds will never be answered, so let
        `collect` stop waiting for them."""
        for seq_id in [s for s, a in self._awaiting.items() if a.endpoint is endpoint]:
            del self._awaiting[seq_id]
