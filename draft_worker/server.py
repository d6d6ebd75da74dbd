"""The draft server: one proposer behind `outrider.v1.DraftService`, shared by many targets.

    target A ══ Draft stream ══> reader A ─┐                      ┌─> outbox A ══> target A
    target B ══ Draft stream ══> reader B ─┼─> pending ─> drafting loop ─┼─> outbox B ══> target B
                                           ┘   (one thread: one       └─> ...
                                                propose() per batch)

Each target holds one bidirectional stream and multiplexes its sequences over it. A reader
thread per stream decodes and checks each DraftRequest (`proto.check_request`) and queues the
updates; a single drafting thread takes *everything* pending, from every stream, and calls
`proposer.propose` once, so drafting batches across sequences and across targets, and the
proposer (not thread-safe) only ever runs on that thread. Targets choose their own seq_ids,
so each (stream, seq_id) gets a server-wide internal id before it reaches the proposer.

An update that cannot be served (bad bytes, over budget) gets no tree, and its sequence is
dropped until the target re-syncs it with `reset`: the drafter's copy of its context would
otherwise silently miss tokens. The target decodes such a sequence unspeculated meanwhile.

`serve()` wraps the servicer in a gRPC server with health checking, reflection, message size
limits, optional TLS and an optional shared token (`TokenInterceptor`); inside
Ray the same `DraftServicer` is added to whatever server the deployment runs.
"""

from __future__ import annotations

import hmac
import logging
import math
import queue
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass, replace

import grpc
import torch

from outrider.draft_worker.proposer import Proposer
from outrider.draft_worker.spec_cache import SpecCache, SpecCacheConfig, supports_speculation
from outrider.proto import (
    CandidateTree,
    DraftRequest,
    HandshakeMismatchError,
    HandshakeRequest,
    HandshakeResponse,
    InvalidDraftError,
    Limits,
    SamplingParams,
    SequenceUpdate,
    TreeBudget,
    check_handshake,
    check_request,
    projection_chunks,
    projection_sha256,
)
from outrider.proto import outrider_pb2 as pb
from outrider.proto import outrider_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

DRAFT_SERVICE = pb.DESCRIPTOR.services_by_name["DraftService"].full_name  # "outrider.v1.DraftService"
DEFAULT_MAX_MESSAGE_BYTES = 64 << 20  # a 256-sequence batch of 64-node trees is ~1 MiB
DEFAULT_MAX_BATCH = 256
DEFAULT_SPEC_CACHE = SpecCacheConfig()
_WINDOW_EMA = 0.3  # weight of the newest idle window in its running average


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
    drafting_s: float = 0.0  # time inside propose()
    # The speculation cache (draft_worker.spec_cache): trees answered without drafting,
    # eligible updates that found none, drafting time the hits saved, time spent pre-drafting.
    spec_cache_hits: int = 0
    spec_cache_misses: int = 0
    spec_cache_saved_s: float = 0.0
    spec_drafting_s: float = 0.0
    spec_interrupted: int = 0  # guesses abandoned at a draft step because a real round came in
    spec_gated: int = 0  # rounds not speculated for while guesses rarely came true
    trees_pushed: int = 0  # pre-drafted trees sent ahead of their round (SpeculativeTree)


class _Stream:
    """One target connection: its outbox and its sequences' internal ids."""

    def __init__(self, number: int):
        self.number = number
        self.outbox: queue.SimpleQueue[pb.DraftResponse | None] = queue.SimpleQueue()
        self.internal: dict[int, int] = {}  # the target's seq_id -> the proposer's
        self.desynced: set[int] = set()  # the target's seq_ids waiting for a `reset`
        self.closed = False  # no more updates are taken; set under the batcher's lock


# A queued item: an update with its validation error (None = fine), or None = close the stream.
_Item = tuple[_Stream, SequenceUpdate | None, InvalidDraftError | None]


class DraftBatcher:
    """The drafting loop: gathers pending updates from all streams, one propose per batch."""

    def __init__(
        self,
        proposer: Proposer,
        identity: DraftIdentity,
        limits: Limits,
        speculation_cache: SpecCacheConfig | None = DEFAULT_SPEC_CACHE,
    ):
        self.proposer, self.identity, self.limits = proposer, identity, limits
        self._stats = ServerStats()
        use_cache = speculation_cache is not None and supports_speculation(proposer)
        self.spec_cache = SpecCache(proposer, speculation_cache) if use_cache else None
        self._cond = threading.Condition()
        self._pending: list[_Item] = []
        self._streams: set[_Stream] = set()
        self._busy = False  # a batch is being drafted
        # Speculation only fills idle time it fits in: a real round that arrives while a guess
        # is being drafted waits for it. `_window_s` = how long the drafter usually idles
        # between real rounds (EMA), timed from `_idle_since` (the end of the last real batch).
        self._idle_since: float | None = None
        self._window_s: float | None = None
        self._stopping = False
        self._next_stream = self._next_internal = 0
        self._owner: dict[int, tuple[_Stream, int]] = {}  # internal id -> (stream, target's seq_id)
        self._thread = threading.Thread(target=self._run, name="draft-batcher", daemon=True)
        self._thread.start()

    @property
    def stats(self) -> ServerStats:
        if self.spec_cache is not None:
            spec = self.spec_cache.stats
            self._stats.spec_cache_hits, self._stats.spec_cache_misses = spec.hits, spec.misses
            self._stats.spec_cache_saved_s, self._stats.spec_drafting_s = spec.saved_s, spec.drafting_s
            self._stats.spec_interrupted, self._stats.spec_gated = spec.interrupted, spec.gated
        return self._stats

    def open_stream(self) -> _Stream:
        with self._cond:
            self._next_stream += 1
            self._stats.streams_opened += 1
            stream = _Stream(self._next_stream)
            self._streams.add(stream)
            return stream

    def submit(self, stream: _Stream, message: pb.DraftRequest) -> None:
        """Decode and check one request (reader thread), then queue it for the next batch."""
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
                return  # draining: rounds that arrive after the close marker are not served
            if self._idle_since is not None:
                self._observe_window(time.perf_counter() - self._idle_since)
            self._pending.extend(items)
            self._cond.notify()

    def close_stream(self, stream: _Stream) -> None:
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
        while True:
            with self._cond:
                while not self._pending and not self._stopping and not self._idle_work():
                    self._cond.wait()
                if self._stopping:
                    return
                items, self._pending = self._pending, []
                self._busy = bool(items)
            if not items:  # idle: pre-draft one sequence's next round
                self._speculate()
                continue
            try:
                self._draft(items)
            finally:
                with self._cond:
                    self._busy = False
                    if self._pending:  # the next round came in while this one drafted: no idle time
                        self._observe_window(0.0)
                    else:
                        self._idle_since = time.perf_counter()
                    self._cond.notify_all()

    def _observe_window(self, seconds: float) -> None:
        self._idle_since = None
        ema = self._window_s
        self._window_s = seconds if ema is None else ema + _WINDOW_EMA * (seconds - ema)

    def _idle_work(self) -> bool:
        return self.spec_cache is not None and self.spec_cache.has_work() and self._outcomes_that_fit() > 0

    def _outcomes_that_fit(self) -> int:
        """Outcomes to pre-draft now: as many as should be done before the next real round."""
        most = self.spec_cache.config.max_outcomes
        cost, window = self.spec_cache.outcome_cost_s, self._window_s
        if cost is None or window is None or self._idle_since is None:
            return most  # nothing measured yet: try
        left = window - (time.perf_counter() - self._idle_since)
        # Rounded up: a guess still drafting when the real round comes is interrupted at its
        # next draft step (Proposer.interrupted), which costs less than the hits a cautious
        # cut gives up (draft_model at batch 1: 1.0-1.07x co-located this way, 0.88-0.93x
        # when only outcomes that fit 75% of the window were started).
        return min(most, math.ceil(left / cost)) if cost > 0 else most

    def _speculate(self) -> None:
        """One sequence's speculation, each tree pushed to its target as soon as it is drafted;
        it stops when a real round arrives or the next outcome would not fit the idle window."""

        def push(seq_id: int, update: SequenceUpdate, tree: CandidateTree) -> None:
            if seq_id not in self._owner:
                return
            stream, target_id = self._owner[seq_id]
            guess = pb.SpeculativeTree(
                new_tokens=update.new_tokens.tolist(), tree=replace(tree, seq_id=target_id).to_proto()
            )
            self._stats.trees_pushed += 1
            stream.outbox.put(pb.DraftResponse(speculative=[guess]))

        try:
            self.spec_cache.run_one(
                max_outcomes=max(1, self._outcomes_that_fit()),
                # Breadth first: another sequence's likeliest guess beats this one's next.
                keep_going=lambda: (
                    not (self._pending or self.spec_cache.has_work()) and self._outcomes_that_fit() > 0
                ),
                push=push,
                interrupted=lambda: bool(self._pending),  # a real round came in
            )
        except Exception:  # a failed guess costs only the cache
            log.exception("speculation failed")

    def _draft(self, items: list[_Item]) -> None:
        batch: dict[int, SequenceUpdate] = {}  # internal id -> this batch's (merged) update
        closing: list[_Stream] = []
        for stream, update, error in items:
            if update is None:
                closing.append(stream)
            elif error is not None:
                self._stats.invalid_updates += 1
                log.warning("stream %d: %s; the sequence waits for a reset", stream.number, error)
                stream.desynced.add(update.seq_id)
                self._forget(stream, update.seq_id, batch)
            elif update.seq_id in stream.desynced and not update.reset:
                continue
            else:
                stream.desynced.discard(update.seq_id)
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
        if batch and self.spec_cache is not None:
            if any(u.finished for u in batch.values()):
                self.spec_cache.retired()
            hits = {u.seq_id: self.spec_cache.lookup(u) for u in batch.values()}
            for update in batch.values():  # a hit's round is speculated on like a drafted one
                if hits[update.seq_id] is not None:
                    self.spec_cache.schedule(update, hits[update.seq_id])
            # A target that answered the round from the pushed guess needs no copy of it.
            self._send([t for i, t in hits.items() if t is not None and not batch[i].answered])
            batch = {i: u for i, u in batch.items() if hits[i] is None}
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
            trees = self.proposer.propose(updates)
        except Exception:  # a proposer bug must cost these trees, not the server
            log.exception("propose failed for %d sequences; they wait for a reset", len(updates))
            for stream, seq_id in owners.values():
                stream.desynced.add(seq_id)
                self._forget(stream, seq_id, None)
            return
        finally:
            self._stats.drafting_s += time.perf_counter() - started
            self._stats.batches += 1
        if self.spec_cache is not None:
            by_id = {u.seq_id: u for u in updates}
            for tree in trees:
                self.spec_cache.schedule(by_id[tree.seq_id], tree)
        self._send(trees)

    def _send(self, trees: list[CandidateTree]) -> None:
        """Send trees (proposer ids) to their streams, re-labelled with the targets' seq_ids."""
        replies: dict[_Stream, list[pb.CandidateTree]] = {}
        for tree in trees:
            if tree.seq_id not in self._owner:
                continue
            stream, seq_id = self._owner[tree.seq_id]
            tree.seq_id = seq_id
            replies.setdefault(stream, []).append(tree.to_proto())
        for stream, messages in replies.items():
            self._stats.trees_sent += len(messages)
            for start in range(0, len(messages), self.limits.max_batch):
                stream.outbox.put(pb.DraftResponse(trees=messages[start : start + self.limits.max_batch]))

    def _internal_id(self, stream: _Stream, seq_id: int) -> int:
        internal = stream.internal.get(seq_id)
        if internal is None:
            self._next_internal += 1
            internal = stream.internal[seq_id] = self._next_internal
            self._owner[internal] = (stream, seq_id)
        return internal

    def _forget(self, stream: _Stream, seq_id: int, batch: dict[int, SequenceUpdate] | None) -> None:
        """Drop a sequence's id; with `batch`, also queue a `finished` so the proposer frees its state."""
        internal = stream.internal.pop(seq_id, None)
        if internal is None:
            return
        self._owner.pop(internal, None)
        if self.spec_cache is not None:
            self.spec_cache.forget(internal)
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


class DraftServicer(pb_grpc.DraftServiceServicer):
    """The DraftService methods; add to any grpc.Server with `add_to_server`."""

    def __init__(self, batcher: DraftBatcher):
        self.batcher = batcher
        spec = batcher.proposer.feature_spec
        self._projection = batcher.proposer.feature_projection() if spec.projected else None
        if spec.projected and self._projection is None:
            raise ValueError(f"{batcher.proposer.method}: projected features but no feature_projection()")
        self._projection_sha256 = projection_sha256(self._projection) if self._projection is not None else ""

    def add_to_server(self, server: grpc.Server) -> None:
        pb_grpc.add_DraftServiceServicer_to_server(self, server)

    def handshake_response(self) -> HandshakeResponse:
        identity, proposer = self.batcher.identity, self.batcher.proposer
        return HandshakeResponse(
            draft_model_id=identity.draft_model_id,
            vocab_size=identity.vocab_size,
            vocab_fingerprint=identity.vocab_fingerprint,
            method=proposer.method,
            limits=self.batcher.limits,
            features=proposer.feature_spec,
            target_model_id=identity.target_model_id,
            projection_sha256=self._projection_sha256,
        )

    def Handshake(self, request: pb.HandshakeRequest, context: grpc.ServicerContext) -> pb.HandshakeResponse:
        response = self.handshake_response()
        try:
            check_handshake(HandshakeRequest.from_proto(request), response)
        except HandshakeMismatchError as error:
            log.warning("refused target %r: %s", request.target_model_id, error)
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(error))
        return response.to_proto()

    def FeatureProjection(
        self, request: pb.FeatureProjectionRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.Tensor]:
        if self._projection is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this drafter publishes no feature projection")
        yield from projection_chunks(self._projection, request.max_chunk_bytes)

    def Draft(
        self, request_iterator: Iterator[pb.DraftRequest], context: grpc.ServicerContext
    ) -> Iterator[pb.DraftResponse]:
        stream = self.batcher.open_stream()
        # Runs when the RPC ends for any reason (target gone, cancelled, deadline, shutdown).
        context.add_callback(lambda: (self.batcher.close_stream(stream), stream.outbox.put(None)))
        reader = threading.Thread(
            target=self._read,
            args=(stream, request_iterator),
            name=f"draft-read-{stream.number}",
            daemon=True,
        )
        reader.start()
        while (response := stream.outbox.get()) is not None:
            yield response

    def _read(self, stream: _Stream, requests: Iterator[pb.DraftRequest]) -> None:
        try:
            for message in requests:
                self.batcher.submit(stream, message)
        except grpc.RpcError:
            pass  # the target went away mid-read; close_stream below frees its sequences
        finally:
            self.batcher.close_stream(stream)


@dataclass(frozen=True)
class ServerTls:
    """PEM bytes. With `client_ca`, targets must present a certificate it signed (mutual TLS)."""

    cert_chain: bytes
    private_key: bytes
    client_ca: bytes | None = None

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials(
            [(self.private_key, self.cert_chain)],
            root_certificates=self.client_ca,
            require_client_auth=self.client_ca is not None,
        )


class TokenInterceptor(grpc.ServerInterceptor):
    """Refuses any call without `authorization: Bearer <token>`, except health checks.

    Health is exempt so that load balancers and Kubernetes gRPC probes, which cannot send
    metadata, can still see the server; it reveals nothing but SERVING / NOT_SERVING.
    """

    def __init__(self, token: str):
        self._expected = f"Bearer {token}".encode()

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(details)
        if handler is None or details.method.startswith("/grpc.health.v1.Health/"):
            return handler
        given = dict(details.invocation_metadata or ()).get("authorization", "")
        if hmac.compare_digest(str(given).encode(), self._expected):
            return handler

        def refuse(request: object, context: grpc.ServicerContext) -> None:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong `authorization: Bearer` token")

        kind = {
            (False, False): grpc.unary_unary_rpc_method_handler,
            (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler,
            (True, True): grpc.stream_stream_rpc_method_handler,
        }[(handler.request_streaming, handler.response_streaming)]
        return kind(refuse)


class DraftServer:
    """A running gRPC server: DraftService + health + reflection. `stop()` drains first."""

    def __init__(self, server: grpc.Server, servicer: DraftServicer, health: object, port: int):
        self.server, self.servicer, self.health, self.port = server, servicer, health, port

    @property
    def stats(self) -> ServerStats:
        return self.servicer.batcher.stats

    def stop(self, grace_s: float = 5.0) -> None:
        """Report NOT_SERVING, answer every round already received, end the streams, stop."""
        self.health.enter_graceful_shutdown()
        drained = self.servicer.batcher.drain(grace_s)
        if not drained:
            log.warning("draft server stopped with rounds still in flight after %.1f s", grace_s)
        self.server.stop(grace_s).wait()
        self.servicer.batcher.stop()

    def wait(self, timeout_s: float | None = None) -> bool:
        return self.server.wait_for_termination(timeout_s)


def serve(
    proposer: Proposer,
    identity: DraftIdentity,
    *,
    address: str = "[::]:0",
    tls: ServerTls | None = None,
    token: str | None = None,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    max_batch: int = DEFAULT_MAX_BATCH,
    max_streams: int = 64,
    speculation_cache: SpecCacheConfig | None = DEFAULT_SPEC_CACHE,
) -> DraftServer:
    """Start serving `proposer` on `address` ("host:port"; port 0 = any free port).

    `speculation_cache` None turns pre-drafting off; it is off anyway for proposers that
    cannot fork their state (see draft_worker.spec_cache).
    """
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection

    budget = proposer.config.budget
    limits = Limits(max_batch, budget.max_nodes, budget.max_depth, budget.top_k, budget.row_width)
    servicer = DraftServicer(DraftBatcher(proposer, identity, limits, speculation_cache))
    workers = max_streams + 8
    interceptors = [TokenInterceptor(token)] if token else []
    # Every Draft stream holds a pool thread for its lifetime; the rest serve unary calls.
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="draft-rpc"),
        interceptors=interceptors,
        options=[
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
        ],
        maximum_concurrent_rpcs=workers,
    )
    servicer.add_to_server(server)
    health_servicer = health.HealthServicer()
    for name in ("", DRAFT_SERVICE):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    health_name = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
    reflection.enable_server_reflection((DRAFT_SERVICE, health_name, reflection.SERVICE_NAME), server)
    port = server.add_secure_port(address, tls.credentials()) if tls else server.add_insecure_port(address)
    server.start()
    log.info("draft server (%s) listening on port %d", proposer.method, port)
    return DraftServer(server, servicer, health_servicer, port)
