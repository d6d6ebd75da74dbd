"""The drafting loop: every stream's pending updates, one `propose` per batch, on one thread.

    target A ══ Draft stream ══> reader A ─┐                      ┌─> outbox A ══> target A
    target B ══ Draft stream ══> reader B ─┼─> pending ─> drafting loop ─┼─> outbox B ══> target B
                                           ┘   (one thread: one       └─> ...
                                                propose() per batch)

A reader thread per stream (`servicer.py`) decodes and checks each DraftRequest
(`proto.check_request`) and queues the updates; a single drafting thread takes *everything*
pending, from every stream, and calls `proposer.propose` once, so drafting batches across
sequences and across targets, and the proposer (not thread-safe) only ever runs on that
thread. Targets choose their own seq_ids, so each (stream, seq_id) gets a server-wide
internal id before it reaches the proposer.

An update that cannot be served (bad bytes, over budget) gets no tree, and its sequence is
dropped until the target re-syncs it with `reset`: the drafter's copy of its context would
otherwise silently miss tokens. The target decodes such a sequence unspeculated meanwhile.

With a speculation cache (`draft_worker.speculation.Speculator`) the loop also answers rounds
from pre-drafted trees and, when nothing is pending and the idle window has room, pre-drafts
the next round of one sequence at a time.

Fairness between targets (a pool shared by several target deployments): the drafting loop
takes every stream's pending rounds into one batch, and a stream's reader waits once
`max_pending` of its requests are queued, so one target's burst can make a batch larger but
never push another target's round past the next batch. Trees sent are counted per target
(`ServerStats.trees_by_target`, by the label each target's stream opens with).

A target is trusted with nothing that could exhaust the server (`StreamLimits`): a stream
holding too many sequences or context tokens, or sending nothing but invalid updates, is
ended with a gRPC status that says which (`StreamError`) and its sequences are freed; the
target reconnects and re-syncs. A stream whose requests or answers pile up faster than they
are drafted or read has its reader wait, so the backlog stays in gRPC's flow control and not
in this server's memory.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field, replace

import grpc
import torch

from outrider.draft_worker.proposer import Proposer
from outrider.draft_worker.server.streams import (
    DEFAULT_STREAM_LIMITS,
    Stream,
    StreamError,
    StreamLimits,
    oversized,
)
from outrider.draft_worker.speculation import SpecCacheConfig, Speculator, supports_speculation
from outrider.proto import (
    CandidateTree,
    DraftRequest,
    InvalidDraftError,
    Limits,
    SamplingParams,
    SequenceUpdate,
    TreeBudget,
    check_request,
)
from outrider.proto import outrider_pb2 as pb

log = logging.getLogger(__name__)

DEFAULT_SPEC_CACHE = SpecCacheConfig()


@dataclass(frozen=True)
class DraftIdentity:
    """What the drafter says about itself at the handshake."""

    draft_model_id: str
    vocab_size: int
    vocab_fingerprint: str  # proto.vocab_fingerprint of the tokenizer it drafts in
    target_model_id: str = ""  # the target it was trained for; "" = any


@dataclass
class ServerStats:
    streams_opened: int = 0
    batches: int = 0  # propose() calls
    trees_sent: int = 0
    invalid_updates: int = 0
    streams_refused: int = 0  # ended with a status for breaking StreamLimits
    drafting_s: float = 0.0  # time inside propose()
    # The speculation cache (draft_worker.speculation): trees answered without drafting,
    # eligible updates that found none, drafting time the hits saved, time spent pre-drafting.
    spec_cache_hits: int = 0
    spec_cache_misses: int = 0
    spec_cache_saved_s: float = 0.0
    spec_drafting_s: float = 0.0
    spec_interrupted: int = 0  # guesses abandoned at a draft step because a real round came in
    spec_gated: int = 0  # rounds not speculated for while guesses rarely came true
    trees_pushed: int = 0  # pre-drafted trees sent ahead of their round (SpeculativeTree)
    # A pool shared by several target deployments: trees per target label (`Stream.target`).
    trees_by_target: dict[str, int] = field(default_factory=dict)


# A queued item: an update with its validation error (None = fine); (None, None) = close the
# stream; (None, StreamError) = refuse it.
_Item = tuple[Stream, SequenceUpdate | None, InvalidDraftError | StreamError | None]


class DraftBatcher:
    """The drafting loop: gathers pending updates from all streams, one propose per batch."""

    def __init__(
        self,
        proposer: Proposer,
        identity: DraftIdentity,
        limits: Limits,
        speculation_cache: SpecCacheConfig | None = DEFAULT_SPEC_CACHE,
        stream_limits: StreamLimits = DEFAULT_STREAM_LIMITS,
    ):
        self.proposer, self.identity, self.limits = proposer, identity, limits
        self.stream_limits = stream_limits
        self._stats = ServerStats()
        use_cache = speculation_cache is not None and supports_speculation(proposer)
        self.speculator = Speculator(proposer, speculation_cache) if use_cache else None
        self._cond = threading.Condition()
        self._pending: list[_Item] = []
        self._streams: set[Stream] = set()
        self._busy = False  # a batch is being drafted
        self._stopping = False
        self._next_stream = self._next_internal = 0
        self._owner: dict[int, tuple[Stream, int]] = {}  # internal id -> (stream, target's seq_id)
        self._thread = threading.Thread(target=self._run, name="draft-batcher", daemon=True)
        self._thread.start()

    @property
    def stats(self) -> ServerStats:
        if self.speculator is not None:
            spec = self.speculator.stats
            self._stats.spec_cache_hits, self._stats.spec_cache_misses = spec.hits, spec.misses
            self._stats.spec_cache_saved_s, self._stats.spec_drafting_s = spec.saved_s, spec.drafting_s
            self._stats.spec_interrupted, self._stats.spec_gated = spec.interrupted, spec.gated
            self._stats.trees_pushed = self.speculator.pushed
        return self._stats

    def open_stream(self, target: str = "") -> Stream:
        with self._cond:
            self._next_stream += 1
            self._stats.streams_opened += 1
            stream = Stream(self._next_stream, self.stream_limits, target)
            self._streams.add(stream)
            return stream

    def submit(self, stream: Stream, message: pb.DraftRequest) -> bool:
        """Decode and check one request (reader thread), then queue it for the next batch.

        Waits while the stream's backlog is full; False once the stream takes no more requests.
        """
        if not self._wait_for_room(stream):
            return False
        too_much = oversized(message, self.stream_limits)
        if too_much is not None:
            self.refuse(stream, too_much)
            return False
        decoded, items = [], []
        for i, update_message in enumerate(message.updates):
            try:
                decoded.append(SequenceUpdate.from_proto(update_message, f"updates[{i}]"))
            except InvalidDraftError as error:
                items.append((stream, _tombstone(update_message.seq_id), error))
        spec = self.proposer.feature_spec
        errors = check_request(
            DraftRequest(decoded), vocab_size=self.identity.vocab_size, limits=self.limits, features=spec
        )
        items.extend((stream, u, e) for u, e in zip(decoded, errors, strict=True))
        with self._cond:
            if stream.closed:
                return False  # draining: rounds that arrive after the close marker are not served
            if self.speculator is not None:
                self.speculator.round_arrived()
            self._pending.extend(items)
            stream.pending += bool(items)  # reset when the drafting loop takes them
            self._cond.notify()
        return True

    def refuse(self, stream: Stream, error: StreamError) -> None:
        """End `stream` with `error` (any thread): it takes nothing more, its sequences are freed."""
        with self._cond:
            if stream.closed:
                return
            stream.closed = True
            self._pending.append((stream, None, error))
            self._cond.notify()

    def _wait_for_room(self, stream: Stream) -> bool:
        """Backpressure: the reader waits while the stream's requests or answers pile up."""
        with self._cond:
            while stream.backlogged() and not (stream.closed or self._stopping):
                self._cond.wait(0.05)  # the outbox is drained by gRPC, which does not notify
            return not (stream.closed or self._stopping)

    def close_stream(self, stream: Stream) -> None:
        """Finish what the stream already sent, free its sequences, then end its response stream."""
        with self._cond:
            if stream.closed:
                return
            stream.closed = True
            self._pending.append((stream, None, None))
            self._cond.notify()

    def drain(self, timeout_s: float) -> bool:
        """Close every stream and wait until their in-flight rounds are answered."""
        with self._cond:
            streams = list(self._streams)
        for stream in streams:
            self.close_stream(stream)
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._pending or self._busy or self._streams:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        speculator = self.speculator
        while True:
            with self._cond:
                while not self._pending and not self._stopping and not self._idle_work():
                    self._cond.wait()
                if self._stopping:
                    return
                items, self._pending = self._pending, []
                self._busy = bool(items)
                for stream, _, _ in items:
                    stream.pending = 0
                self._cond.notify_all()  # readers waiting for room
            if not items:  # idle: pre-draft one sequence's next round
                speculator.speculate(lambda: bool(self._pending), self._route)
                continue
            try:
                self._draft(items)
            finally:
                with self._cond:
                    self._busy = False
                    if speculator is not None:  # rounds already waiting: no idle time
                        speculator.batch_done(bool(self._pending))
                    self._cond.notify_all()

    def _idle_work(self) -> bool:
        return self.speculator is not None and self.speculator.has_idle_work()

    def _route(self, seq_id: int) -> tuple[queue.SimpleQueue, int] | None:
        """Where a pushed guess for the proposer's `seq_id` goes; None once it is forgotten."""
        owner = self._owner.get(seq_id)
        return None if owner is None else (owner[0].outbox, owner[1])

    def _draft(self, items: list[_Item]) -> None:
        batch: dict[int, SequenceUpdate] = {}  # internal id -> this batch's (merged) update
        closing: list[Stream] = []
        for stream, update, error in items:
            if stream.refused:
                continue
            if update is None:
                if isinstance(error, StreamError):
                    self._refuse(stream, error, batch)
                else:
                    closing.append(stream)
            elif error is not None:
                self._stats.invalid_updates += 1
                log.warning("stream %d: %s; the sequence waits for a reset", stream.number, error)
                stream.desynced.add(update.seq_id)
                self._forget(stream, update.seq_id, batch)
                stream.invalid_in_row += 1
                if stream.invalid_in_row >= self.stream_limits.max_invalid_in_row:
                    details = f"{stream.invalid_in_row} invalid updates in a row; the last: {error}"
                    self._refuse(stream, StreamError(grpc.StatusCode.INVALID_ARGUMENT, details), batch)
            elif update.seq_id in stream.desynced and not update.reset:
                continue
            else:
                stream.invalid_in_row = 0
                stream.desynced.discard(update.seq_id)
                exceeded = stream.hold(update)
                if exceeded is not None:
                    self._refuse(stream, exceeded, batch)
                    continue
                internal = self._internal_id(stream, update.seq_id)
                earlier = batch.get(internal)
                batch[internal] = (
                    replace(update, seq_id=internal) if earlier is None else _merge(earlier, update)
                )
                if update.finished:
                    self._forget(stream, update.seq_id, None)
        for stream in closing:
            for seq_id in list(stream.internal):
                self._forget(stream, seq_id, batch)
        if batch and self.speculator is not None:
            hits = self.speculator.answer(batch)
            # A target that answered the round from the pushed guess needs no copy of it.
            self._send([t for i, t in hits.items() if not batch[i].answered])
            batch = {i: u for i, u in batch.items() if i not in hits}
        if batch:
            self._propose(list(batch.values()))
        with self._cond:
            for stream in closing:
                self._streams.discard(stream)
                stream.outbox.put(None)

    def _propose(self, updates: list[SequenceUpdate]) -> None:
        owners = {u.seq_id: self._owner[u.seq_id] for u in updates if u.seq_id in self._owner}
        started = time.perf_counter()
        try:
            if self.speculator is None:  # wrappers and test doubles take the updates alone
                trees = self.proposer.propose(updates)
            else:
                trees = self.proposer.propose(updates, self.speculator.draft_hints())
        except Exception:  # a proposer bug must cost these trees, not the server
            log.exception("propose failed for %d sequences; they wait for a reset", len(updates))
            for stream, seq_id in owners.values():
                stream.desynced.add(seq_id)
                self._forget(stream, seq_id, None)
            return
        finally:
            self._stats.drafting_s += time.perf_counter() - started
            self._stats.batches += 1
        if self.speculator is not None:
            self.speculator.drafted(updates, trees)
        self._send(trees)

    def _send(self, trees: list[CandidateTree]) -> None:
        """Send trees (proposer ids) to their streams, re-labelled with the targets' seq_ids."""
        replies: dict[Stream, list[pb.CandidateTree]] = {}
        for tree in trees:
            if tree.seq_id not in self._owner:
                continue
            stream, seq_id = self._owner[tree.seq_id]
            tree.seq_id = seq_id
            replies.setdefault(stream, []).append(tree.to_proto())
        for stream, messages in replies.items():
            self._stats.trees_sent += len(messages)
            by_target = self._stats.trees_by_target
            by_target[stream.target] = by_target.get(stream.target, 0) + len(messages)
            for start in range(0, len(messages), self.limits.max_batch):
                stream.outbox.put(pb.DraftResponse(trees=messages[start : start + self.limits.max_batch]))

    def _refuse(self, stream: Stream, error: StreamError, batch: dict[int, SequenceUpdate]) -> None:
        """Drafting thread: free the stream's sequences and end it with `error`."""
        log.warning("stream %d refused (%s): %s", stream.number, error.code.name, error.details)
        stream.refused = True
        for seq_id in list(stream.internal):
            self._forget(stream, seq_id, batch)
        with self._cond:
            stream.closed = True
            self._streams.discard(stream)
            self._stats.streams_refused += 1
        stream.outbox.put(error)

    def _internal_id(self, stream: Stream, seq_id: int) -> int:
        internal = stream.internal.get(seq_id)
        if internal is None:
            self._next_internal += 1
            internal = stream.internal[seq_id] = self._next_internal
            self._owner[internal] = (stream, seq_id)
        return internal

    def _forget(self, stream: Stream, seq_id: int, batch: dict[int, SequenceUpdate] | None) -> None:
        """Drop a sequence's id; with `batch`, also queue a `finished` so the proposer frees its state."""
        stream.release(seq_id)
        internal = stream.internal.pop(seq_id, None)
        if internal is None:
            return
        self._owner.pop(internal, None)
        if self.speculator is not None:
            self.speculator.forget(internal)
        if batch is not None:
            batch[internal] = _tombstone(internal)


def _tombstone(seq_id: int) -> SequenceUpdate:
    """A `finished` update carrying nothing: frees a sequence's proposer state."""
    return SequenceUpdate(
        seq_id, 0, torch.empty(0, dtype=torch.int64), SamplingParams(), TreeBudget(1, 0, 0), finished=True
    )


def _merge(earlier: SequenceUpdate, later: SequenceUpdate) -> SequenceUpdate:
    """Two deltas of one sequence queued before a batch ran: apply both, answer the later round."""
    if later.reset:
        return replace(later, seq_id=earlier.seq_id)
    features = None
    if earlier.features is not None and later.features is not None:
        features = torch.cat([earlier.features, later.features])
    return replace(
        later,
        seq_id=earlier.seq_id,
        new_tokens=torch.cat([earlier.new_tokens, later.new_tokens]),
        features=features,
        reset=earlier.reset,
    )
