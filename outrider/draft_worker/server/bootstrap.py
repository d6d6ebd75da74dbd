"""`serve()`: a gRPC server around one proposer, with health checking, reflection, message
size limits, optional TLS and an optional shared token; `DraftServer` stops it gracefully.

Inside Ray the same `DraftServicer` is added to whatever server the deployment runs.
"""

from __future__ import annotations

import logging
from concurrent import futures

import grpc

from outrider.draft_worker.proposer import Proposer
from outrider.draft_worker.server.auth import ServerTls, TokenInterceptor
from outrider.draft_worker.server.batcher import DEFAULT_SPEC_CACHE, DraftBatcher, DraftIdentity, ServerStats
from outrider.draft_worker.server.servicer import DraftServicer
from outrider.draft_worker.server.streams import DEFAULT_STREAM_LIMITS, StreamLimits
from outrider.draft_worker.speculation import SpecCacheConfig
from outrider.proto import Limits
from outrider.proto import outrider_pb2 as pb

log = logging.getLogger(__name__)

DRAFT_SERVICE = pb.DESCRIPTOR.services_by_name["DraftService"].full_name  # "outrider.v1.DraftService"
DEFAULT_MAX_MESSAGE_BYTES = 64 << 20  # a 256-sequence batch of 64-node trees is ~1 MiB
DEFAULT_MAX_BATCH = 256


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
    stream_limits: StreamLimits = DEFAULT_STREAM_LIMITS,
) -> DraftServer:
    """Start serving `proposer` on `address` ("host:port"; port 0 = any free port).

    `speculation_cache` None turns pre-drafting off; it is off anyway for proposers that
    cannot fork their state (see draft_worker.speculation). `stream_limits` bounds what one
    target's stream may make the server hold; `max_streams` streams at most are served at
    once (gRPC answers RESOURCE_EXHAUSTED past them).
    """
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection

    budget = proposer.config.budget
    limits = Limits(max_batch, budget.max_nodes, budget.max_depth, budget.top_k, budget.q_width)
    servicer = DraftServicer(DraftBatcher(proposer, identity, limits, speculation_cache, stream_limits))
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
