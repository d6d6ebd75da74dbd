"""The speculation cache's target side (`draft_client.spec_cache`) through a scripted worker:
pushed guesses are kept as received and checked only when their outcome comes true; one that
comes true answers its round at `submit`, and the worker is told which of its guesses did."""

from __future__ import annotations

import time

import torch
from draft_client_testlib import ScriptedDrafter, client, honest_handshake, start_scripted, target_handshake


class PushingDrafter(ScriptedDrafter):
    """Answers every round with a valid two-node tree and pushes guesses for the next round:
    `guesses(update) -> [(delta, pb.CandidateTree)]`."""

    def __init__(self, handshake, guesses):
        super().__init__(handshake, reply=None)
        self.guesses, self.answered = guesses, []

    def Draft(self, request_iterator, context):
        from outrider.proto import outrider_pb2 as pb

        for request in request_iterator:
            for update in request.updates:
                self.answered.append(update.answered)
                pushed = [
                    pb.SpeculativeTree(new_tokens=delta, tree=tree) for delta, tree in self.guesses(update)
                ]
                yield pb.DraftResponse(speculative=pushed)
                yield pb.DraftResponse(
                    trees=[two_nodes(update.seq_id, update.round, update.new_tokens[-1], 5)]
                )


def two_nodes(seq_id: int, round: int, root: int, child: int):
    from outrider.proto import outrider_pb2 as pb

    return pb.CandidateTree(
        seq_id=seq_id,
        round=round,
        tokens=[root, child],
        parents=[-1, 0],
        sampling=pb.DRAFT_SAMPLING_DETERMINISTIC,
    )


def wait_for_guesses(source, count: int, seq_id: int = 0) -> None:
    deadline = time.monotonic() + 10
    while source.pushed.num_guesses(seq_id) < count:
        assert time.monotonic() < deadline, "the pushed guesses never arrived"
        time.sleep(0.01)


def test_pushed_guesses_are_checked_only_when_their_outcome_comes_true(tiny_family):
    """The receive thread keeps pushed trees as they came (its Python work would stall the
    engine's verify): thirty broken guesses that never come true cost nothing and are never
    counted; a sound one that comes true answers its round with no waiting; a broken one that
    comes true is dropped, counted, and the round falls back to the worker's own answer."""
    from outrider.proto import SamplingParams, SequenceUpdate, TreeBudget
    from outrider.proto import outrider_pb2 as pb

    def guesses(update):
        cycle = dict(seq_id=update.seq_id, round=update.round + 1, parents=[-1, 2, 1])
        wrong = [([100 + i, 9], pb.CandidateTree(tokens=[9, 1, 2], **cycle)) for i in range(30)]
        if update.round == 1:  # round 2 comes with delta [7, 8]: a sound guess for it
            return [*wrong, ([7, 8], two_nodes(update.seq_id, 2, 8, 6))]
        return [*wrong, ([9], pb.CandidateTree(tokens=[9, 1, 2], **cycle))]  # broken, and comes true

    request = target_handshake(tiny_family)
    drafter = PushingDrafter(honest_handshake(request), guesses)
    server, port = start_scripted(drafter)
    source = client(tiny_family, [f"127.0.0.1:{port}"], round_deadline_s=5.0)
    budget = TreeBudget(max_nodes=8, max_depth=4, top_k=2)

    def update(round, tokens):
        return SequenceUpdate(0, round, torch.tensor(tokens), SamplingParams(), budget)

    try:
        assert source.wait_ready(10)
        source.submit([update(1, [1, 2, 3])])
        assert source.collect([0])[0].tokens.tolist() == [3, 5]
        wait_for_guesses(source, 31)  # the guesses for round 2 are in
        assert source.counters.trees_pushed_dropped == 0  # none was decoded
        source.submit([update(2, [7, 8])])
        assert source.counters.trees_pushed_used == 1  # answered at submit, before any reply
        assert source.collect([0], 0.0)[0].tokens.tolist() == [8, 6]
        wait_for_guesses(source, 31)  # ... and those for round 3
        source.submit([update(3, [9])])
        assert source.counters.trees_pushed_dropped == 1 and source.counters.trees_pushed_used == 1
        assert source.collect([0])[0].tokens.tolist() == [9, 5]  # the worker's own answer
        assert source.counters.trees_invalid == 0
        assert drafter.answered == [False, True, False]  # the worker is told which guess was used
    finally:
        source.close()
        server.stop(None)
