"""One target's Draft stream as the batcher keeps it, and what it may make the server hold.

A draft server serves many targets, and one hostile or broken target must not exhaust it.
`StreamLimits` bounds each stream; a stream past them is ended with a `StreamError`, a gRPC
status saying which limit and by how much, and its sequences are freed (the target reconnects
and re-syncs). The checks that need no decoding (`oversized`) run on the reader thread before
a request is decoded; what the stream holds over time (`Stream.hold`) is counted on the
drafting thread, where its sequences live.
"""

from __future__ import annotations

import queue
from dataclasses import dataclass

import grpc

from outrider.proto import SequenceUpdate
from outrider.proto import outrider_pb2 as pb


@dataclass(frozen=True)
class StreamLimits:
    """What one target's Draft stream may make this server hold."""

    max_sequences: int = 4096  # live sequences; past it: RESOURCE_EXHAUSTED
    max_tokens: int = 1 << 24  # context tokens over its sequences (int64: 128 MiB); RESOURCE_EXHAUSTED
    max_invalid_in_row: int = 64  # invalid updates with no valid one between; INVALID_ARGUMENT
    max_pending: int = 4  # requests read but not yet drafted before its reader waits
    max_outbox: int = 64  # answers not yet taken by gRPC before its reader waits


DEFAULT_STREAM_LIMITS = StreamLimits()


@dataclass(frozen=True)
class StreamError:
    """Ends a stream: the servicer aborts the RPC with `code` and `details`."""

    code: grpc.StatusCode
    details: str


class Stream:
    """One target connection: its outbox, its sequences' internal ids, what it holds."""

    def __init__(self, number: int, limits: StreamLimits = DEFAULT_STREAM_LIMITS, target: str = ""):
        self.number, self.limits = number, limits
        self.target = target or f"stream-{number}"  # the target's label (per-target counters)
        self.outbox: queue.SimpleQueue[pb.DraftResponse | StreamError | None] = queue.SimpleQueue()
        self.internal: dict[int, int] = {}  # the target's seq_id -> the proposer's
        self.desynced: set[int] = set()  # the target's seq_ids waiting for a `reset`
        self.closed = False  # no more updates are taken; set under the batcher's lock
        self.pending = 0  # requests queued and not yet taken by the drafting loop (under the lock)
        # Drafting thread only: what the stream holds.
        self.tokens: dict[int, int] = {}  # the target's seq_id -> context tokens sent for it
        self.held_tokens = 0
        self.invalid_in_row = 0
        self.refused = False

    def backlogged(self) -> bool:
        """Its reader should wait: requests or answers pile up faster than they are served."""
        return self.pending >= self.limits.max_pending or self.outbox.qsize() >= self.limits.max_outbox

    def hold(self, update: SequenceUpdate) -> StreamError | None:
        """Count what the stream holds after `update`; the StreamError if that is too much."""
        limits, seq_id = self.limits, update.seq_id
        before = self.tokens.get(seq_id)
        if before is None and not update.finished and len(self.internal) >= limits.max_sequences:
            return StreamError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"seq_id={seq_id} would be this stream's sequence number {len(self.internal) + 1}; "
                f"this draft server holds at most {limits.max_sequences} per stream (finish some first)",
            )
        now = len(update.new_tokens) + (0 if update.reset or before is None else before)
        self.held_tokens += now - (before or 0)
        self.tokens[seq_id] = now
        if update.finished:
            self.release(seq_id)
        if self.held_tokens > limits.max_tokens:
            return StreamError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the stream's sequences hold {self.held_tokens} context tokens; this draft server "
                f"holds at most {limits.max_tokens} per stream",
            )
        return None

    def release(self, seq_id: int) -> None:
        """The sequence's tokens are no longer held."""
        self.held_tokens -= self.tokens.pop(seq_id, 0)


def oversized(message: pb.DraftRequest, limits: StreamLimits) -> StreamError | None:
    """Before decoding it: a request that alone is more than a stream may hold."""
    updates = message.updates
    if len(updates) > limits.max_sequences:
        return StreamError(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"a DraftRequest of {len(updates)} updates; this draft server holds at most "
            f"{limits.max_sequences} sequences per stream",
        )
    tokens = sum(len(update.new_tokens) for update in updates)
    if tokens > limits.max_tokens:
        return StreamError(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"a DraftRequest of {tokens} tokens; this draft server holds at most "
            f"{limits.max_tokens} context tokens per stream",
        )
    return None
