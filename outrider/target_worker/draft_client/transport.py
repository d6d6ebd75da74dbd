"""The connections to the draft workers: one thread per worker, its channel (TLS, token), the
handshake, the Draft stream, and reconnection with backoff.

    channel ──> Handshake ──> (fc, once) ──> Draft stream ──> receive ... stream lost
       ^         checked        agreed          healthy                       │
       └───────────────── backoff, doubled per failed attempt (capped) <──────┘

Every stream opened bumps the endpoint's `generation`: the worker behind it may have
restarted and lost its sequences, so a sequence synced under an older generation is re-sent
whole (`resync`). The restart fence: the stream is opened with the `incarnation` the
handshake reported, and a worker that is another incarnation (it restarted between the
handshake and the stream) refuses it with ABORTED; the thread handshakes again at once. A new
incarnation at a known address is counted as a restart (`draft_restarts`). What arrives on a stream is handed to the client (`on_message`); when the
stream ends, the client drops the rounds that worker still owed (`on_lost`).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import grpc

from outrider.proto import (
    INCARNATION_METADATA,
    STALE_INCARNATION,
    TARGET_METADATA,
    HandshakeMismatchError,
    HandshakeRequest,
    HandshakeResponse,
    Limits,
    check_handshake,
)
from outrider.proto import outrider_pb2 as pb
from outrider.proto import outrider_pb2_grpc as pb_grpc
from outrider.target_worker.draft_client.config import ClientTls, DraftClientConfig, DraftClientCounters
from outrider.target_worker.draft_client.handshake import FeatureAgreement

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Endpoint:
    """One draft worker as the client sees it; every field is read and written under the lock."""

    address: str
    healthy: bool = False
    generation: int = 0  # bumped on every stream opened: the worker's state may be gone
    incarnation: int = 0  # the worker process's, from its last handshake (0: not told)
    limits: Limits | None = None
    last_error: Exception | None = None
    refused: bool = False  # the last handshake was a mismatch
    removed: bool = False  # dropped by set_endpoints: its thread ends
    outbox: queue.SimpleQueue | None = None  # the live stream's requests; None ends it
    call: grpc.Future | None = None
    thread: threading.Thread | None = field(default=None, repr=False)


def open_channel(address: str, max_message_bytes: int, tls: ClientTls | None) -> grpc.Channel:
    options = [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
    ]
    if tls is None:
        return grpc.insecure_channel(address, options=options)
    if tls.server_name:
        options.append(("grpc.ssl_target_name_override", tls.server_name))
    credentials = grpc.ssl_channel_credentials(tls.root_ca, tls.private_key, tls.cert_chain)
    return grpc.secure_channel(address, credentials, options=options)


def drain(outbox: queue.SimpleQueue) -> Iterator[pb.DraftRequest]:
    """The request side of one Draft stream; ends (half-closes) at None."""
    while (request := outbox.get()) is not None:
        yield request


class Connections:
    """The endpoints and their threads. Shares the client's lock (`cond`): routing, the
    sequences and every endpoint's liveness change together."""

    def __init__(
        self,
        handshake: HandshakeRequest,
        config: DraftClientConfig,
        cond: threading.Condition,
        features: FeatureAgreement,
        counters: DraftClientCounters,
        on_message: Callable[[Endpoint, pb.DraftResponse], None],  # takes the lock itself
        on_lost: Callable[[Endpoint], None],  # called under the lock
    ):
        self.handshake, self.config, self.counters = handshake, config, counters
        self._cond, self._features = cond, features
        self._on_message, self._on_lost = on_message, on_lost
        self._closed = threading.Event()
        self.endpoints: list[Endpoint] = []

    def set_addresses(self, addresses: Sequence[str]) -> None:
        """Connect to new addresses, leave the ones gone (their sequences move on their next round)."""
        wanted = list(dict.fromkeys(addresses))
        if not wanted:
            raise ValueError("RemoteDraftSource needs at least one draft worker address")
        with self._cond:
            held = {e.address: e for e in self.endpoints}
            gone = [e for e in self.endpoints if e.address not in wanted]
            added = [Endpoint(address) for address in wanted if address not in held]
            self.endpoints = [
                held.get(address) or next(e for e in added if e.address == address) for address in wanted
            ]
            for endpoint in gone:
                endpoint.removed = True
                self._hang_up(endpoint)
        for endpoint in added:
            endpoint.thread = threading.Thread(
                target=self._connection_loop,
                args=(endpoint,),
                name=f"draft-client-{endpoint.address}",
                daemon=True,
            )
            endpoint.thread.start()  # a removed endpoint's thread ends on its own within a backoff

    def wait_ready(self, timeout_s: float) -> bool:
        """True once some worker is connected; HandshakeMismatchError if every worker refused."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while not any(e.healthy for e in self.endpoints):
                refusals = [e.last_error for e in self.endpoints if e.refused]
                if len(refusals) == len(self.endpoints):
                    raise refusals[0]
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 0.05))
        return True

    def close(self) -> None:
        self._closed.set()
        with self._cond:
            for endpoint in self.endpoints:
                self._hang_up(endpoint)
        for endpoint in self.endpoints:
            endpoint.thread.join(timeout=5)

    def _hang_up(self, endpoint: Endpoint) -> None:
        """End the endpoint's stream (under the lock): half-close, then cancel."""
        if endpoint.outbox is not None:
            endpoint.outbox.put(None)  # half-close: the worker finishes, then ends the stream
        if endpoint.call is not None:
            endpoint.call.cancel()
        endpoint.healthy = False
        self._cond.notify_all()

    # ------------------------------------------------------------------ one worker's thread

    def _connection_loop(self, endpoint: Endpoint) -> None:
        backoff = self.config.backoff_initial_s
        metadata = (("authorization", f"Bearer {self.config.token}"),) if self.config.token else None
        while not (self._closed.is_set() or endpoint.removed):
            channel = open_channel(endpoint.address, self.config.max_message_bytes, self.config.tls)
            try:
                stub = pb_grpc.DraftServiceStub(channel)
                if self._connect(endpoint, stub, metadata):
                    backoff = self.config.backoff_initial_s
                    self._receive_loop(endpoint)
            finally:
                channel.close()
            self._closed.wait(backoff)
            backoff = min(2 * backoff, self.config.backoff_max_s)

    def _connect(self, endpoint: Endpoint, stub: pb_grpc.DraftServiceStub, metadata: tuple | None) -> bool:
        """Handshake and open the stream; False (with `last_error` set) if either fails."""
        try:
            reply = stub.Handshake(
                self.handshake.to_proto(), timeout=self.config.connect_timeout_s, metadata=metadata
            )
            response = HandshakeResponse.from_proto(reply)
            limits = check_handshake(self.handshake, response)
            projection = self._features.fetch_projection(
                stub,
                response,
                metadata,
                max_message_bytes=self.config.max_message_bytes,
                connect_timeout_s=self.config.connect_timeout_s,
            )
            with self._cond:
                self._features.agree(endpoint.address, response, projection)
        except HandshakeMismatchError as error:
            self._refused(endpoint, error)
            return False
        except grpc.RpcError as error:
            if error.code() == grpc.StatusCode.FAILED_PRECONDITION:  # the worker refused us
                self._refused(endpoint, HandshakeMismatchError([f"{endpoint.address}: {error.details()}"]))
            else:
                endpoint.last_error = error
            return False
        outbox: queue.SimpleQueue = queue.SimpleQueue()
        with self._cond:
            if self._closed.is_set() or endpoint.removed:
                return False
            fence = ((INCARNATION_METADATA, str(response.incarnation)),) if response.incarnation else ()
            label = ((TARGET_METADATA, self.config.target_label),) if self.config.target_label else ()
            endpoint.call = stub.Draft(drain(outbox), metadata=(*(metadata or ()), *fence, *label))
            if endpoint.generation > 0:
                self.counters.reconnects += 1
            if endpoint.incarnation and response.incarnation != endpoint.incarnation:
                self.counters.draft_restarts += 1
            endpoint.generation += 1
            endpoint.incarnation = response.incarnation
            endpoint.limits, endpoint.outbox = limits, outbox
            endpoint.healthy, endpoint.refused, endpoint.last_error = True, False, None
            self._cond.notify_all()
        log.info(
            "draft worker %s (%s, %s): connected; its sampled trees are verified %s",
            endpoint.address,
            response.draft_model_id,
            response.method,
            "with its q (trusted by configuration, audited)"
            if self.config.trust_q
            else "as deterministic proposals (its q is not trusted)",
        )
        return True

    def _receive_loop(self, endpoint: Endpoint) -> None:
        try:
            for message in endpoint.call:
                self._on_message(endpoint, message)
        except grpc.RpcError as error:
            endpoint.last_error = error
            if error.code() == grpc.StatusCode.ABORTED and STALE_INCARNATION in (error.details() or ""):
                self.counters.stale_streams += 1  # refused by the fence: handshake again
            if not self._closed.is_set():
                log.warning(
                    "draft worker %s: stream lost (%s: %s)", endpoint.address, error.code(), error.details()
                )
        finally:
            with self._cond:
                endpoint.healthy = False
                endpoint.outbox.put(None)
                self._on_lost(endpoint)
                self._cond.notify_all()

    def _refused(self, endpoint: Endpoint, error: HandshakeMismatchError) -> None:
        log.error("draft worker %s refused: %s", endpoint.address, error)
        with self._cond:
            self.counters.handshake_refusals += 1
            endpoint.refused, endpoint.last_error = True, error
            self._cond.notify_all()
