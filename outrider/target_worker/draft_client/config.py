"""What the draft client is configured with, and what it counts."""

from __future__ import annotations

from dataclasses import dataclass

from outrider.proto import FeatureSpec


@dataclass(frozen=True)
class ClientTls:
    """PEM bytes: the CA that signed the draft servers, and our own pair for mutual TLS."""

    root_ca: bytes
    cert_chain: bytes | None = None
    private_key: bytes | None = None
    server_name: str | None = None  # the name to expect in the server's certificate, if not the host


@dataclass(frozen=True)
class DraftClientConfig:
    round_deadline_s: float = 0.05  # what collect(timeout_s=None) waits at most
    connect_timeout_s: float = 2.0  # per handshake attempt
    backoff_initial_s: float = 0.05  # reconnect delay, doubled per failed attempt
    backoff_max_s: float = 2.0
    resync_after_misses: int = 3  # rounds with no answer at all before a sequence is re-sent whole
    max_message_bytes: int = 64 << 20
    token: str | None = None  # sent as `authorization: Bearer <token>` on every call
    tls: ClientTls | None = None
    features: FeatureSpec = FeatureSpec()  # expected until a worker's handshake says otherwise
    trust_q: bool = False  # verify with the workers' q (the operator trusts their sampling; audited)
    target_label: str = ""  # who this target is to a shared draft pool (its per-target counters)


@dataclass
class DraftClientCounters:
    trees_received: int = 0  # valid and in time for their round
    trees_late: int = 0  # arrived after their round was collected
    trees_invalid: int = 0  # failed validation; dropped
    trees_missing: int = 0  # rounds that `collect` closed without a tree
    reconnects: int = 0  # streams re-established after one was lost
    resyncs: int = 0  # full contexts re-sent (worker restarted, sequence moved, dropped)
    handshake_refusals: int = 0
    draft_restarts: int = 0  # a worker answered a handshake as a new incarnation (it restarted)
    stale_streams: int = 0  # Draft streams a worker refused: opened for the incarnation it replaced
    trees_pushed_used: int = 0  # rounds a pre-drafted tree answered before they were asked (also received)
    trees_pushed_dropped: int = 0  # pre-drafted trees that failed their checks (malformed, over budget)
