"""The draft deployment: each replica runs the gRPC draft server; targets find them by registry.

Targets talk to drafters over gRPC, not through Serve handles: a round is a bidirectional
stream of small protobuf messages with a deadline of tens of milliseconds, which Serve's
request path (pickled arguments, a router hop) would eat. So each replica starts
`draft_worker.server.serve` on a port and announces `host:port` in Ray's key-value store
under `outrider/<app>/draft/<replica>`, refreshed every few seconds; a target lists the fresh
entries (`draft_endpoints`) and hands them to `RemoteDraftSource`, which routes each
sequence to one of them, stickily. An entry nobody refreshed for `STALE_S` is a dead replica.

The replica also reports its own load to the autoscaler (`record_autoscaling_stats`): Serve's
default signal, requests in flight, would see nothing, because rounds never pass through Serve.
"""

from __future__ import annotations

import json
import logging
import threading
import time

import ray
from ray import serve
from ray.experimental import internal_kv

from outrider.cluster.served_model import ServedModel

log = logging.getLogger(__name__)
HEARTBEAT_S = 2.0
STALE_S = 10.0
NAMESPACE = "outrider"


def registry_prefix(app_name: str) -> str:
    return f"outrider/{app_name}/draft/"


def draft_announcements(app_name: str) -> list[dict]:
    """What each draft replica of `app_name` announced recently: address, replica, counters."""
    now, found = time.time(), []
    for key in internal_kv._internal_kv_list(registry_prefix(app_name), namespace=NAMESPACE):
        value = internal_kv._internal_kv_get(key, namespace=NAMESPACE)
        if value is None:
            continue
        entry = json.loads(value)
        if now - entry["time"] < STALE_S:
            found.append(entry)
    return sorted(found, key=lambda e: e["address"])


def draft_endpoints(app_name: str) -> list[str]:
    """Addresses of the draft replicas of `app_name` that announced themselves recently."""
    return [entry["address"] for entry in draft_announcements(app_name)]


def wait_for_draft_endpoints(app_name: str, timeout_s: float = 120.0) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = draft_endpoints(app_name)
        if found:
            return found
        time.sleep(0.2)
    raise TimeoutError(f"no draft replica of application {app_name!r} announced itself in {timeout_s:.0f} s")


@serve.deployment(name="DraftWorker", health_check_period_s=5)
class DraftWorker:
    """One proposer behind a gRPC draft server, shared by every target replica."""

    def __init__(
        self, model: ServedModel, speculative_config: dict, grpc_port: int = 0, pool: dict | None = None
    ):
        from outrider import draft_worker  # noqa: F401 - registers the built-in methods
        from outrider.cluster.config import DraftPoolArgs
        from outrider.cluster.tp_shards import default_device
        from outrider.draft_worker.proposer import build_proposer
        from outrider.draft_worker.server import DraftIdentity
        from outrider.draft_worker.server import serve as serve_grpc
        from outrider.target_worker.draft_client import tokenizer_fingerprint

        # The replica's GPU when Ray gave it one (draft pools on small GPUs), else the CPU.
        proposer = build_proposer(speculative_config, vocab_size=model.vocab_size, device=default_device())
        tls, token = DraftPoolArgs.model_validate(pool or {"mode": "deployment"}).server_security()
        identity = DraftIdentity(
            draft_model_id=str(speculative_config.get("model") or speculative_config["method"]),
            vocab_size=model.vocab_size,
            vocab_fingerprint=tokenizer_fingerprint(model.tokenizer_dir),
        )
        self.server = serve_grpc(proposer, identity, address=f"0.0.0.0:{grpc_port}", tls=tls, token=token)
        self.address = f"{ray.util.get_node_ip_address()}:{self.server.port}"
        context = serve.get_replica_context()
        self.replica = context.replica_id.unique_id
        self._key = registry_prefix(context.app_name) + self.replica
        self._stop = threading.Event()
        self._announce()
        threading.Thread(target=self._heartbeat, name="draft-registry", daemon=True).start()
        self._last = (time.monotonic(), 0.0, 0)  # (wall, drafting_s, batches) at the last report
        log.info("draft replica serving %s on %s", speculative_config["method"], self.address)

    def _announce(self) -> None:
        """Address and counters; the ingress's /metrics reads the counters from here too."""
        s = self.server.stats
        entry = {
            "address": self.address,
            "replica": f"draft-{self.replica}",
            "time": time.time(),
            "trees_sent": s.trees_sent,
            "cache_hits": s.spec_cache_hits,
            "cache_lookups": s.spec_cache_hits + s.spec_cache_misses,
            "cache_saved_s": s.spec_cache_saved_s,
            "trees_pushed": s.trees_pushed,
        }
        internal_kv._internal_kv_put(
            self._key, json.dumps(entry).encode(), overwrite=True, namespace=NAMESPACE
        )

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            self._announce()

    async def endpoint(self) -> str:
        return self.address

    async def stats(self) -> dict:
        s = self.server.stats
        return {
            "address": self.address,
            "batches": s.batches,
            "trees_sent": s.trees_sent,
            "drafting_s": s.drafting_s,
        }

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
        try:
            internal_kv._internal_kv_del(self._key, namespace=NAMESPACE)
        except Exception as e:  # Ray may already be gone at interpreter exit; the entry goes stale
            log.debug("draft registry entry not removed: %s", e)
        self.server.stop(grace_s=2.0)
