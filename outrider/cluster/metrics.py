"""`/metrics`: Prometheus text format, vLLM's metric names under an `outrider:` prefix.

Three sources, one page:

    ingress (this process)        per request: TTFT, inter-token latency, end-to-end latency,
                                  prompt/generation tokens, finished requests, API errors
    target replicas               `ReplicaSnapshot`: spec_decode_* (kernels.SpecDecodeCounters),
                                  running/waiting sequences, batch occupancy, KV-cache usage,
                                  prefix-cache queries/hits, preemptions, draft round trip
    draft replicas                `DraftAnnouncement` counters: speculation-cache hits, trees
                                  sent and pushed (read from the draft registry)

Each replica's counters are cumulative since it started, so the ingress keeps the latest
ones per replica and sums them (`ReplicaSnapshot.total`): losing a snapshot loses nothing, and a scrape that
lands on any ingress replica sees every target replica it has heard from. Latencies are
measured at the ingress because that is what a client sees.

Names (docs/algorithms.md section 8): counters end in `_total` as prometheus_client writes them,
so `outrider:spec_decode_num_drafts_total` lines up with vLLM's `vllm:spec_decode_num_drafts_total`.
"""

from __future__ import annotations

import bisect
import math
import threading
import time
from dataclasses import dataclass, field

from outrider.cluster.messages import DraftAnnouncement, ReplicaSnapshot, by_target

PREFIX = "outrider:"
LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0)


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
        self.resumes = 0  # choices moved to another target replica after theirs died (cluster.resume)
        self.snapshots: dict[str, ReplicaSnapshot] = {}  # target replica -> its latest counters
        self.drafts: dict[str, DraftAnnouncement] = {}  # draft replica -> its latest counters

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

    def resumed(self, error: BaseException) -> None:
        with self._lock:
            self.resumes += 1

    def snapshot(self, snap: ReplicaSnapshot) -> None:
        with self._lock:
            self.snapshots[snap.replica] = snap

    def draft_snapshots(self, announcements: list[DraftAnnouncement]) -> None:
        """The draft replicas' latest counters (all of them: departed replicas' counts stay)."""
        with self._lock:
            for announcement in announcements:
                self.drafts[announcement.replica] = announcement

    # --------------------------------------------------------------- rendering

    def render(self) -> str:
        with self._lock:
            replicas = len(self.snapshots)
            t = ReplicaSnapshot.total(list(self.snapshots.values()))
            d = DraftAnnouncement.total(list(self.drafts.values()))
            labels = f'model_name="{self.model_name}"'
            lines: list[str] = []

            def metric(name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> None:
                lines.append(f"# HELP {PREFIX}{name} {help_}")
                lines.append(f"# TYPE {PREFIX}{name} {kind}")
                suffix = "_total" if kind == "counter" else ""
                for extra, value in samples:
                    lines.append(f"{PREFIX}{name}{suffix}{{{labels}{extra}}} {value}")

            def counter(name: str, value: float, help_: str) -> None:
                metric(name, "counter", help_, [("", value)])

            counter(
                "spec_decode_num_drafts", t.num_drafts, "Sequences verified with at least one draft token."
            )
            counter("spec_decode_num_draft_tokens", t.num_draft_tokens, "Draft tokens sent to the verifier.")
            counter("spec_decode_num_accepted_tokens", t.num_accepted_tokens, "Draft tokens accepted.")
            counter("engine_steps", t.steps, "Engine steps (one verify forward each).")
            counter(
                "draft_round_trips",
                t.draft_round_trips,
                "Rounds whose trees were collected from the draft source.",
            )
            counter(
                "draft_trees_missing",
                t.trees_missing,
                "Sequence-rounds decoded without a tree (deadline, no drafter).",
            )
            metric(
                "spec_decode_num_accepted_tokens_per_pos",
                "counter",
                "Drafts whose accepted path reached position + 1.",
                [(f',position="{p}"', n) for p, n in enumerate(t.num_accepted_tokens_per_pos)],
            )
            metric(
                "spec_decode_mean_acceptance_length",
                "gauge",
                "Output tokens per verify step for drafted sequences: 1 + accepted / drafts.",
                [("", 1.0 + t.num_accepted_tokens / t.num_drafts if t.num_drafts else 0.0)],
            )
            metric(
                "spec_decode_acceptance_rate",
                "gauge",
                "Accepted / draft tokens.",
                [("", t.num_accepted_tokens / t.num_draft_tokens if t.num_draft_tokens else 0.0)],
            )
            metric("num_requests_running", "gauge", "Sequences in the engine's batch.", [("", t.running)])
            metric("num_requests_waiting", "gauge", "Requests queued for the batch.", [("", t.waiting)])
            metric(
                "kv_cache_usage_perc",
                "gauge",
                "KV-cache usage: blocks held by sequences / all blocks (1 = full), over target replicas.",
                [("", _ratio(t.kv_blocks_used, t.kv_blocks_total))],
            )
            counter(
                "prefix_cache_queries", t.prefix_cache_queries, "Prompt tokens looked up in the prefix cache."
            )
            counter("prefix_cache_hits", t.prefix_cache_hits, "Prompt tokens found in the prefix cache.")
            counter(
                "num_preemptions", t.num_preemptions, "Sequences preempted for recompute (KV blocks ran out)."
            )
            metric(
                "batch_occupancy",
                "gauge",
                "Running sequences / batch slots, over target replicas.",
                [("", t.running / t.max_num_seqs if t.max_num_seqs else 0.0)],
            )
            slots_per_replica = max(t.max_num_seqs / max(replicas, 1), 1)
            metric(
                "batch_occupancy_mean",
                "gauge",
                "Mean sequences per engine step / batch slots, since start.",
                [("", _ratio(t.batch_seq_sum, t.steps) / slots_per_replica)],
            )
            metric(
                "draft_round_trip_seconds_mean",
                "gauge",
                "Mean time the engine waited to collect a round's trees.",
                [("", _ratio(t.draft_round_trip_s, t.draft_round_trips))],
            )
            metric(
                "draft_verification_mode",
                "gauge",
                "1 per target replica, labelled with how it verifies its draft source's trees: draft_q "
                "(the drafter's q is trusted), deterministic (not trusted), deterministic_after_audit "
                "(trusted until the audit caught a q that lies).",
                [
                    (f',replica="{r}",mode="{snap.draft_verification}"', 1)
                    for r, snap in sorted(self.snapshots.items())
                    if snap.draft_verification
                ],
            )
            counter(
                "draft_trees_demoted",
                t.trees_demoted,
                "Sampled trees verified as deterministic proposals because their q is not trusted.",
            )
            counter(
                "draft_audit_children",
                t.audited_children,
                "Children of trusted sampled trees whose p/q the audit checked.",
            )
            metric(
                "draft_audit_mean_ratio",
                "gauge",
                "Mean p(x)/q(x) over audited children: at most 1 for an honest drafter.",
                [("", _ratio(t.audit_ratio_sum, t.audited_children))],
            )
            lines.append(
                f"# HELP {PREFIX}spec_decode_draft_depth Draft depth the speculation policy gave each sequence-round (0: none)."
            )
            lines.append(f"# TYPE {PREFIX}spec_decode_draft_depth histogram")
            cumulative = 0
            for depth, count in enumerate(t.budget_depths):
                cumulative += count
                lines.append(f'{PREFIX}spec_decode_draft_depth_bucket{{{labels},le="{depth}"}} {cumulative}')
            lines.append(f'{PREFIX}spec_decode_draft_depth_bucket{{{labels},le="+Inf"}} {cumulative}')
            lines.append(f"{PREFIX}spec_decode_draft_depth_count{{{labels}}} {cumulative}")
            lines.append(
                f"{PREFIX}spec_decode_draft_depth_sum{{{labels}}} {sum(d * n for d, n in enumerate(t.budget_depths))}"
            )
            counter(
                "spec_policy_predicted_tokens",
                t.policy_predicted_tokens,
                "Tokens the adaptive speculation policy expected its budgets to commit (sum over sequence-rounds).",
            )
            counter(
                "spec_policy_measured_tokens",
                t.policy_measured_tokens,
                "Tokens those sequence-rounds committed: compare with spec_policy_predicted_tokens.",
            )
            counter(
                "spec_policy_shadow_drafts",
                t.policy_shadow_drafts,
                "Drafts of greedy sequences the policy held off, scored in hindsight, never verified.",
            )
            counter(
                "spec_policy_shadow_kept_tokens",
                t.policy_shadow_kept_tokens,
                "Tokens of those shadow drafts the target then committed (would have been kept).",
            )
            counter("spec_cache_hits", d.cache_hits, "Draft rounds answered from the speculation cache.")
            counter(
                "spec_cache_lookups", d.cache_lookups, "Draft rounds that looked in the speculation cache."
            )
            counter("draft_trees_sent", d.trees_sent, "Candidate trees the draft replicas sent.")
            metric(
                "draft_trees_sent_by_target",
                "counter",
                "Candidate trees the draft replicas sent, per target application (a shared pool).",
                [(f',target="{t}"', n) for t, n in sorted(by_target(list(self.drafts.values())).items())],
            )
            counter(
                "draft_trees_pushed",
                d.trees_pushed,
                "Pre-drafted trees the draft replicas pushed ahead of their round (speculation cache).",
            )
            metric(
                "spec_cache_hit_rate",
                "gauge",
                "Speculation-cache hits / lookups over the draft replicas (0 when none reports).",
                [("", _ratio(d.cache_hits, d.cache_lookups))],
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
            counter(
                "request_resumes",
                self.resumes,
                "Choices resumed on another target replica after theirs died mid-request.",
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


def _ratio(num: float, den: float) -> float:
    return num / den if den else 0.0
