"""`outrider.v1.DraftService`: handshake, feature projection and the Draft stream of each target.

Each target holds one bidirectional Draft stream and multiplexes its sequences over it. The
servicer gives each stream a reader thread that hands its requests to the batcher
(`batcher.py`) and yields the stream's outbox back to the target; the batcher does the rest.
"""

from __future__ import annotations

import logging
import secrets
import threading
from collections.abc import Iterator

import grpc

from outrider.draft_worker.server.batcher import DraftBatcher
from outrider.draft_worker.server.streams import Stream, StreamError
from outrider.proto import (
    TARGET_METADATA,
    HandshakeMismatchError,
    HandshakeRequest,
    HandshakeResponse,
    check_handshake,
    projection_chunks,
    projection_sha256,
    stale_incarnation,
)
from outrider.proto import outrider_pb2 as pb
from outrider.proto import outrider_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)


class DraftServicer(pb_grpc.DraftServiceServicer):
    """The DraftService methods; add to any grpc.Server with `add_to_server`."""

    def __init__(self, batcher: DraftBatcher):
        self.batcher = batcher
        spec = batcher.proposer.feature_spec
        self._projection = batcher.proposer.feature_projection() if spec.projected else None
        if spec.projected and self._projection is None:
            raise ValueError(f"{batcher.proposer.method}: projected features but no feature_projection()")
        self._projection_sha256 = projection_sha256(self._projection) if self._projection is not None else ""
        # The restart fence (proto.handshake): a restarted server draws a new one.
        self.incarnation = secrets.randbits(63) | 1

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
            incarnation=self.incarnation,
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
        metadata = dict(context.invocation_metadata() or ())
        stale = stale_incarnation(metadata.items(), self.incarnation)
        if stale is not None:  # the target handshook with the process this one replaced
            context.abort(grpc.StatusCode.ABORTED, stale)
        stream = self.batcher.open_stream(target=metadata.get(TARGET_METADATA, ""))
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
            if isinstance(response, StreamError):  # the batcher refused the stream: say why
                context.abort(response.code, response.details)
            yield response

    def _read(self, stream: Stream, requests: Iterator[pb.DraftRequest]) -> None:
        try:
            for message in requests:
                if not self.batcher.submit(stream, message):
                    break
        except grpc.RpcError:
            pass  # the target went away mid-read; close_stream below frees its sequences
        except Exception as error:  # a request this server cannot read must cost its stream only
            log.exception("stream %d: reading a request failed", stream.number)
            details = f"the draft server could not read a request: {type(error).__name__}: {error}"
            self.batcher.refuse(stream, StreamError(grpc.StatusCode.INVALID_ARGUMENT, details))
        finally:
            self.batcher.close_stream(stream)
