"""Who may talk to the draft server: TLS (optionally mutual) and a shared bearer token."""

from __future__ import annotations

import hmac
from collections.abc import Callable
from dataclasses import dataclass

import grpc


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
