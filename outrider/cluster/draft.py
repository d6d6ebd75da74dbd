"""The draft deployment: each replica runs the gRPC draft server; targets find them by registry.

Targets talk to drafters over gRPC, not through Serve handles: a round is a bidirectional
stream of small protobuf messages with a deadline of tens of milliseconds, which Serve's
request path (pickled arguments, a router hop) would eat. So each replica starts
`draft_worker.server.serve` on a port and announces `host:port`, with its counters, to the
application's draft registry (`cluster.draft_registry`, a named Ray actor) every
`HEARTBEAT_S`; a target lists the fresh entries and hands them to `RemoteDraftSource`, which
routes each sequence to one of them, stickily. An entry nobody refreshed for `STALE_S` is a
dead replica.

The replica also reports its own load to the autoscaler (`record_autoscaling_stats`): Serve's
default signal, requests in flight, would see nothing, because rounds never pass through Serve.
"""

from __future__ import annotations

import logging
import threading
import time

import ray
from ray import serve

from outrider.cluster.draft_registry import HEARTBEAT_S, STALE_S, open_registry
from outrider.cluster.messages import DraftAnnouncement
from outrider.cluster.served_model import ServedModel

log = logging.getLogger(__name__)


@serve.deployment(name="DraftWorker", health_check_period_s=5)
class DraftWorker:
    """One proposer behind a gRPC draft server, shared by every target replica."""

    def __init__(
        self,
        model: ServedModel,
        speculative_config: dict,
        grpc_port: int = 0,
        pool: dict | None = None,
        max_sequences: int = 32,
    ):
        from outrider import draft_worker  # noqa: F401 - registers the built-in methods
        from outrider.cluster.config import DraftPoolArgs
        from outrider.cluster.tp_shards import default_device
        from outrider.draft_worker.proposer import build_proposer
        from outrider.draft_worker.server import DraftIdentity
        from outrider.draft_worker.server import serve as serve_grpc
        from outrider.proto.gc_heap import freeze_gc_heap
        from outrider.target_worker.draft_client import tokenizer_fingerprint

        # The replica's GPU when Ray gave it one (draft pools on small GPUs), else the CPU.
        proposer = build_proposer(
            speculative_config,
            vocab_size=model.vocab_size,
            device=default_device(),
            max_sequences=max_sequences,
        )
        tls, token = DraftPoolArgs.model_validate(pool or {"mode": "deployment"}).server_security()
        identity = DraftIdentity(
            draft_model_id=str(speculative_config.get("model") or speculative_config["method"]),
            vocab_size=model.vocab_size,
            vocab_fingerprint=tokenizer_fingerprint(model.tokenizer_dir),
        )
        self.server = serve_grpc(proposer, identity, address=f"0.0.0.0:{grpc_port}", tls=tls, token=token)
        self.address = f"{ray.util.get_node_ip_address()}:{self.server.port}"
        context = serve.get_replica_context()
        self.replica, self.app_name = f"draft-{context.replica_id.unique_id}", context.app_name
        self._registry = None  # opened by the first heartbeat
        self._stop = threading.Event()
        threading.Thread(target=self._heartbeat, name="draft-registry", daemon=True).start()
        self._last = (time.monotonic(), 0.0, 0)  # (wall, drafting_s, batches) at the last report
        log.info("draft replica serving %s on %s", speculative_config["method"], self.address)
        freeze_gc_heap("draft replica")  # start-up done: full collections skip all it made

    def _announcement(self) -> DraftAnnouncement:
        """Address and counters; the ingress's /metrics reads the counters from the registry too."""
        s = self.server.stats
        return DraftAnnouncement(
            address=self.address,
            replica=self.replica,
            trees_sent=s.trees_sent,
            cache_hits=s.spec_cache_hits,
            cache_lookups=s.spec_cache_hits + s.spec_cache_misses,
            cache_saved_s=s.spec_cache_saved_s,
            trees_pushed=s.trees_pushed,
            batches=s.batches,
            drafting_s=s.drafting_s,
            trees_by_target=tuple(sorted(s.trees_by_target.items())),
        )

    def _heartbeat(self) -> None:
        while True:
            try:
                if self._registry is None:
                    self._registry = open_registry(self.app_name)
                # The first call waits for the registry actor to start, which takes seconds.
                ray.get(self._registry.announce.remote(self._announcement()), timeout=STALE_S)
            except Exception as e:  # the registry's node went away: open (re-create) it next beat
                log.warning("draft registry unreachable: %s", e)
                self._registry = None
            if self._stop.wait(HEARTBEAT_S):
                return

    async def endpoint(self) -> str:
        return self.address

    async def stats(self) -> DraftAnnouncement:
        return self._announcement()

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Share of wall time spent drafting since the last report: near 1, rounds queue up."""
        now, stats = time.monotonic(), self.server.stats
        wall, drafting, batches = self._last
        self._last = (now, stats.drafting_s, stats.batches)
        busy = (stats.drafting_s - drafting) / max(now - wall, 1e-6)
        batch_ms = 1000 * (stats.drafting_s - drafting) / max(stats.batches - batches, 1)
        return {"draft_busy_fraction": min(busy, 1.0), "draft_batch_ms": batch_ms}

    def __del__(self) -> None:
        self._stop.set()
        if self._registry is not None:  # otherwise the entry goes stale within STALE_S
            try:
                self._registry.withdraw.remote(self.replica)
            except Exception as e:  # Ray may already be gone at interpreter exit
                log.debug("draft registry entry not removed: %s", e)
        self.server.stop(grace_s=2.0)
