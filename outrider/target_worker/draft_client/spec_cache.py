"""The speculation cache, target side: trees a draft worker pushed before their round was asked.

While the target verifies round r, the worker guesses its outcomes (the tokens round r+1's
update will carry) and pre-drafts a tree for each (`SpeculativeTree`: the delta it assumes,
and the tree). When round r+1's update comes true for one of them, that tree answers the
round at `submit`, with no round trip, and the update tells the worker so (`answered`): it
sends no duplicate, and learns which of its guesses came true in time.

    receive thread:  SpeculativeTree(delta, tree) ──> kept as received, per sequence and delta
    engine thread:   submit(update: delta d) ──> guess for d, round r+1? ──> checked ──> answers r+1
                                                 the rest are dropped: they will never come true

A guess is decoded and checked only when its delta comes true: this runs on the receive
thread while the engine's thread verifies, Python work here holds the GIL that thread needs
between its torch ops, and most guesses never come true, so a guess costs a dict entry until
it is used. Every method runs under the client's lock.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

from outrider.proto import CandidateTree, InvalidDraftError, TreeBudget, check_trees
from outrider.proto import outrider_pb2 as pb
from outrider.target_worker.draft_client.config import DraftClientCounters
from outrider.target_worker.draft_client.rounds import Rounds
from outrider.target_worker.draft_client.transport import Endpoint

log = logging.getLogger(__name__)


@dataclass
class _Guesses:
    """One sequence's pushed trees, from the worker it was last routed to."""

    endpoint: Endpoint  # only this worker's guesses count
    budget: TreeBudget  # of the sequence's last update
    pushed: dict[tuple[int, ...], pb.SpeculativeTree] = field(default_factory=dict)  # delta -> as received
    answered: int = -1  # the last round a pushed tree answered; the worker's own answer is a duplicate


class PushedTrees:
    def __init__(self, rounds: Rounds, counters: DraftClientCounters, vocab_size: int):
        self._rounds, self.counters, self.vocab_size = rounds, counters, vocab_size
        self._guesses: dict[int, _Guesses] = {}

    def forget(self, seq_id: int) -> None:
        """The sequence finished or starts afresh: its guesses and answers no longer apply."""
        self._guesses.pop(seq_id, None)

    def num_guesses(self, seq_id: int) -> int:
        """Pushed trees kept for the sequence's next round."""
        guesses = self._guesses.get(seq_id)
        return len(guesses.pushed) if guesses is not None else 0

    def answered(self, seq_id: int, round: int) -> bool:
        guesses = self._guesses.get(seq_id)
        return guesses is not None and guesses.answered == round

    def on_submit(
        self,
        seq_id: int,
        endpoint: Endpoint,
        budget: TreeBudget,
        delta: tuple[int, ...],
        round: int,
        fresh: bool,
    ) -> bool:
        """The sequence's update for `round` goes to `endpoint`; True if a guess answered the round.

        `fresh`: the worker is sent the whole sequence (a reset, a move, a restart), so what it
        guessed before cannot be trusted. Every other guess is dropped: it will never come true.
        """
        guesses = self._guesses.get(seq_id)
        pushed = guesses.pushed.get(delta) if guesses is not None and not fresh else None
        if guesses is None:
            guesses = self._guesses[seq_id] = _Guesses(endpoint, budget)
        else:
            guesses.endpoint, guesses.budget, guesses.pushed = endpoint, budget, {}
        if pushed is None or pushed.tree.round != round:
            return False
        tree = self._checked(endpoint, pushed, budget, delta)
        if tree is None:
            return False
        self._answer(seq_id, guesses, tree)  # the worker guessed this outcome: no waiting
        return True

    def receive(self, endpoint: Endpoint, pushed: Sequence[pb.SpeculativeTree]) -> None:
        """Pushed trees from the receive thread: kept as received, decoded and checked only when
        their outcome comes true (here, if their round is open already; else at `on_submit`)."""
        for message in pushed:
            seq_id, delta, round_ = message.tree.seq_id, tuple(message.new_tokens), message.tree.round
            guesses = self._guesses.get(seq_id)
            if guesses is None or guesses.endpoint is not endpoint or not delta:
                continue  # gone, moved, or never asked
            awaited = self._rounds.awaited(seq_id)
            if awaited is not None and awaited.round == round_:  # its round is open already
                if awaited.delta == delta and awaited.endpoint is endpoint:
                    tree = self._checked(endpoint, message, awaited.budget, delta)
                    if tree is not None:
                        self._answer(seq_id, guesses, tree)
            elif round_ > guesses.answered and (awaited is None or round_ > awaited.round):
                guesses.pushed[delta] = message

    def _answer(self, seq_id: int, guesses: _Guesses, tree: CandidateTree) -> None:
        self._rounds.answer(seq_id, tree)
        guesses.answered = tree.round
        self.counters.trees_pushed_used += 1

    def _checked(
        self, endpoint: Endpoint, message: pb.SpeculativeTree, budget: TreeBudget, delta: tuple[int, ...]
    ) -> CandidateTree | None:
        """The pushed tree, decoded and checked against the round's budget; None (counted) if bad.

        Unasked guesses are counted apart from invalid answers: one drafted under the last
        budget may not fit the next (it shrinks near max_tokens).
        """
        try:
            tree = CandidateTree.from_proto(message.tree)
            (error,) = check_trees([tree], [budget], self.vocab_size)
        except InvalidDraftError as invalid:
            error = invalid
        if error is None and int(tree.tokens[0]) != delta[-1]:
            error = "wrong root"
        if error is None:
            return tree
        log.debug("draft worker %s: dropped a pushed tree: %s", endpoint.address, error)
        self.counters.trees_pushed_dropped += 1
        return None
