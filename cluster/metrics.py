"""`/metrics`: Prometheus text format, vLLM's metric names under an `outrider:` prefix.

Two sources, one page:

    ingress (this process)        per request: TTFT, inter-token latency, end-to-end latency,
                                  prompt/generation tokens, finished requests, API errors
    target replicas (snapshots)   engine counters: spec_decode_* (kernels.SpecDecodeCounters),
                                  running/waiting sequences, batch occupancy, draft round trip,
                                  draft-side speculation-cache hits

Each target replica's snapshot is cumulative since it started, so the ingress keeps the
latest one per replica and sums them: losing a snapshot loses nothing, and a scrape that
lands on any ingress replica sees every target replica it has heard from. Latencies are
measured at the ingress because that is what a client sees.

Names (ALGORITHMS.md section 8): counters end in `_total` as prometheus_client writes them,
so `outrider:spec_decode_num_drafts_total` lines up with vLLM's `vllm:spec_decode_num_drafts_total`.
"""

from __future__ import annotations

import bisect
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any

PREFIX = "outrider:"
LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0)

# Snapshot keys a target replica sends -> (metric name, kind, help).
SNAPSHOT_COUNTERS = {
    "num_drafts": ("spec_decode_num_drafts", "Sequences verified with at least one draft token."),
    "num_draft_tokens": ("spec_decode_num_draft_tokens", "Draft tokens sent to the verifier."),
    "num_accepted_tokens": ("spec_decode_num_accepted_tokens", "Draft tokens accepted."),
    "steps": ("engine_steps", "Engine steps (one verify forward each)."),
    "draft_round_trips": ("draft_round_trips", "Rounds whose trees were collected from the draft source."),
    "trees_missing": (
        "draft_trees_missing",
        "Sequence-rounds decoded without a tree (deadline, no drafter).",
    ),
}
# Keys each draft replica announces with its address (`cluster.draft`) -> (metric name, help).
DRAFT_COUNTERS = {
    "cache_hits": ("spec_cache_hits", "Draft rounds answered from the speculation cache."),
    "cache_lookups": ("spec_cache_lookups", "Draft rounds that looked in the speculation cache."),
    "trees_sent": ("draft_trees_sent", "Candidate trees the draft replicas sent."),
    "trees_pushed": (
        "draft_trees_pushed",
        "Pre-drafted trees the draft replicas pushed ahead of their round (speculation cache).",
    ),
}
SNAPSHOT_GAUGES = {
    "running": ("num_requests_running", "Sequences in the engine's batch."),
    "waiting": ("num_requests_waiting", "Requests queued for a batch slot."),
}


@dataclass
class Histogram:
    buckets: tuple[float, ...] = LATENCY_BUCKETS
    counts: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS) + 1))
    total: float = 0.0
    count: int = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.count += 1

    def lines(self, name: str, labels: str) -> list[str]:
        out, cumulative = [], 0
        for bound, n in zip((*self.buckets, math.inf), self.counts, strict=True):
            cumulative += n
            le = "+Inf" if bound == math.inf else repr(bound)
            out.append(f'{name}_bucket{{{labels},le="{le}"}} {cumulative}')
        out.append(f"{name}_sum{{{labels}}} {self.total}")
        out.append(f"{name}_count{{{labels}}} {self.count}")
        return out


class Metrics:
    """The ingress's view: its own request histograms plus the latest snapshot per target replica."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self._lock = threading.Lock()
        self.ttft = Histogram()
        self.itl = Histogram()
        self.e2e = Histogram()
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.finished: dict[str, int] = {}
        self.errors: dict[int, int] = {}
        self.snapshots: dict[str, dict[str, Any]] = {}  # target replica -> its latest counters
        self.drafts: dict[str, dict[str, Any]] = {}  # draft replica -> its latest counters

    # --------------------------------------------------------------- recording

    def request_done(self, prompt_tokens: int, token_times: list[float], start: float, reason: str) -> None:
        with self._lock:
            self.prompt_tokens += prompt_tokens
            self.generation_tokens += len(token_times)
            self.finished[reason] = self.finished.get(reason, 0) + 1
            if token_times:
                self.ttft.observe(token_times[0] - start)
                for earlier, later in zip(token_times, token_times[1:], strict=False):
                    self.itl.observe(later - earlier)
            self.e2e.observe(time.monotonic() - start)

    def error(self, status: int) -> None:
        with self._lock:
            self.errors[status] = self.errors.get(status, 0) + 1

    def snapshot(self, snap: dict[str, Any]) -> None:
        with self._lock:
            self.snapshots[str(snap.get("replica", "?"))] = snap

    def draft_snapshots(self, snaps: list[dict[str, Any]]) -> None:
        """The draft replicas' latest counters (all of them: departed replicas' counts stay)."""
        with self._lock:
            for snap in snaps:
                self.drafts[str(snap.get("replica", "?"))] = snap

    # --------------------------------------------------------------- rendering

    def render(self) -> str:
        with self._lock:
            snaps = list(self.snapshots.values())
            draft_snaps = list(self.drafts.values())
            labels = f'model_name="{self.model_name}"'
            lines: list[str] = []

            def metric(name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> None:
                lines.append(f"# HELP {PREFIX}{name} {help_}")
                lines.append(f"# TYPE {PREFIX}{name} {kind}")
                suffix = "_total" if kind == "counter" else ""
                for extra, value in samples:
                    lines.append(f"{PREFIX}{name}{suffix}{{{labels}{extra}}} {value}")

            for key, (name, help_) in SNAPSHOT_COUNTERS.items():
                metric(name, "counter", help_, [("", sum(s.get(key, 0) for s in snaps))])
            per_pos = _sum_lists([s.get("num_accepted_tokens_per_pos", []) for s in snaps])
            metric(
                "spec_decode_num_accepted_tokens_per_pos",
                "counter",
                "Drafts whose accepted path reached position + 1.",
                [(f',position="{p}"', n) for p, n in enumerate(per_pos)],
            )
            drafts = sum(s.get("num_drafts", 0) for s in snaps)
            accepted = sum(s.get("num_accepted_tokens", 0) for s in snaps)
            draft_tokens = sum(s.get("num_draft_tokens", 0) for s in snaps)
            metric(
                "spec_decode_mean_acceptance_length",
                "gauge",
                "Output tokens per verify step for drafted sequences: 1 + accepted / drafts.",
                [("", 1.0 + accepted / drafts if drafts else 0.0)],
            )
            metric(
                "spec_decode_acceptance_rate",
                "gauge",
                "Accepted / draft tokens.",
                [("", accepted / draft_tokens if draft_tokens else 0.0)],
            )
            for key, (name, help_) in SNAPSHOT_GAUGES.items():
                metric(name, "gauge", help_, [("", sum(s.get(key, 0) for s in snaps))])
            capacity = sum(s.get("max_num_seqs", 0) for s in snaps)
            running = sum(s.get("running", 0) for s in snaps)
            metric(
                "batch_occupancy",
                "gauge",
                "Running sequences / batch slots, over target replicas.",
                [("", running / capacity if capacity else 0.0)],
            )
            metric(
                "batch_occupancy_mean",
                "gauge",
                "Mean sequences per engine step / batch slots, since start.",
                [("", _ratio(snaps, "batch_seq_sum", "steps") / max(capacity / max(len(snaps), 1), 1))],
            )
            metric(
                "draft_round_trip_seconds_mean",
                "gauge",
                "Mean time the engine waited to collect a round's trees.",
                [("", _ratio(snaps, "draft_round_trip_s", "draft_round_trips"))],
            )
            for key, (name, help_) in DRAFT_COUNTERS.items():
                metric(name, "counter", help_, [("", sum(s.get(key, 0) for s in draft_snaps))])
            lookups = sum(s.get("cache_lookups", 0) for s in draft_snaps)
            metric(
                "spec_cache_hit_rate",
                "gauge",
                "Speculation-cache hits / lookups over the draft replicas (0 when none reports).",
                [("", sum(s.get("cache_hits", 0) for s in draft_snaps) / lookups if lookups else 0.0)],
            )
            metric("prompt_tokens", "counter", "Prompt tokens processed.", [("", self.prompt_tokens)])
            metric("generation_tokens", "counter", "Tokens generated.", [("", self.generation_tokens)])
            metric(
                "request_success",
                "counter",
                "Finished requests by finish reason.",
                [(f',finished_reason="{r}"', n) for r, n in sorted(self.finished.items())],
            )
            metric(
                "request_errors",
                "counter",
                "Requests answered with an error, by HTTP status.",
                [(f',status="{s}"', n) for s, n in sorted(self.errors.items())],
            )
            for name, hist, help_ in (
                ("time_to_first_token_seconds", self.ttft, "Time to first token, at the ingress."),
                ("inter_token_latency_seconds", self.itl, "Time between output tokens, at the ingress."),
                ("e2e_request_latency_seconds", self.e2e, "Request latency, at the ingress."),
            ):
                lines.append(f"# HELP {PREFIX}{name} {help_}")
                lines.append(f"# TYPE {PREFIX}{name} histogram")
                lines.extend(hist.lines(PREFIX + name, labels))
            return "\n".join(lines) + "\n"


def _sum_lists(lists: list[list[int]]) -> list[int]:
    out: list[int] = []
    for values in lists:
        out.extend([0] * (len(values) - len(out)))
        for i, v in enumerate(values):
            out[i] += v
    return out


def _ratio(snaps: list[dict[str, Any]], num: str, den: str) -> float:
    d = sum(s.get(den, 0) for s in snaps)
    return sum(s.get(num, 0) for s in snaps) / d if d else 0.0
