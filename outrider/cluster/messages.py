"""What crosses between the deployments: one frozen dataclass per message, no magic keys.

    OpenAIIngress ──GenerateRequest──────────────> TargetWorker.generate
                  <──StreamChunk (admitted) ─────  first, before any HTTP status is sent
                  <──StreamChunk (token ids) ────  then the token deltas; the last one carries
                                                   the replica's ReplicaSnapshot
                  <──ReplicaSnapshot ────────────  TargetWorker.stats, on each /metrics scrape
    DraftWorker ───DraftAnnouncement──> DraftRegistry ──> targets (addresses), ingress (counters)

Serve pickles handle arguments and streamed values, and Ray pickles actor calls, so these
travel as they are; a renamed field fails where it is read, instead of reading as 0. The
sampling settings inside a request are the engine's own `RequestParams` (the proto
`SamplingParams` is only their wire form to drafters, `RequestParams.sampling`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from outrider.target_worker.sequence import RequestParams, TokenLogprob


@dataclass(frozen=True)
class GenerateRequest:
    """One choice of one API request, in token ids: the ingress asks a target replica for it."""

    prompt_token_ids: tuple[int, ...]  # [num_prompt_tokens], already checked against the vocabulary
    params: RequestParams  # max_tokens fitted to the context; stop strings stay at the ingress
    # Tokens the choice already emitted (a resume after its replica died): the engine continues
    # after them as its own output (penalties, grammar, min/max_tokens count them).
    output_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class StreamChunk:
    """One item of a target replica's stream for one request.

    The first item is `admitted` (no tokens): the request holds a batch slot or queue place,
    so overload is known before the ingress sends its HTTP status. Every later item is a
    delta of output tokens; the one with a `finish_reason` is the last and carries `snapshot`.
    """

    token_ids: tuple[int, ...] = ()  # [num_new_tokens] committed since the previous chunk
    finish_reason: str | None = None  # None until the last chunk: "length", "stop", "abort"
    admitted: bool = False
    snapshot: ReplicaSnapshot | None = None
    logprobs: tuple[TokenLogprob, ...] | None = None  # [num_new_tokens], when the request asked
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None  # [num_prompt - 1], with the first tokens (echo)


@dataclass(frozen=True)
class ReplicaSnapshot:
    """A target replica's counters, cumulative since it started (so the latest one suffices)."""

    replica: str
    num_drafts: int = 0  # sequences verified with at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: tuple[int, ...] = ()  # [max depth seen]; drafts reaching pos + 1
    steps: int = 0  # engine rounds (one verify forward each)
    trees_missing: int = 0  # sequence-rounds decoded without a tree
    running: int = 0  # sequences in the engine's batch now
    waiting: int = 0  # requests queued for it now (in the replica or in the engine)
    kv_blocks_used: int = 0  # KV cache blocks held by sequences now
    kv_blocks_total: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # and found there
    num_preemptions: int = 0  # sequences preempted (KV blocks taken back) for recompute
    max_num_seqs: int = 0  # batch slots
    batch_seq_sum: int = 0  # sequences in the batch, summed over steps
    draft_round_trips: int = 0  # rounds whose trees were collected (0 without a draft source)
    draft_round_trip_s: float = 0.0  # time spent waiting in those collects
    trees_late: int = 0  # gRPC drafting only: trees that arrived after their round
    trees_invalid: int = 0  # gRPC drafting only: trees dropped by validation
    draft_verification: str = ""  # how its draft source's trees are verified (`VerificationMode`); "" = none
    trees_demoted: int = 0  # sampled trees verified as deterministic proposals (q not trusted)
    audited_children: int = 0  # children of trusted sampled trees whose p/q the audit checked
    audit_ratio_sum: float = 0.0  # sum of their p(x) / q(x): the mean is <= 1 for an honest drafter
    budget_depths: tuple[int, ...] = ()  # [d] = sequence-rounds the policy gave draft depth d
    policy_predicted_tokens: float = 0.0  # tokens the policy expected those sequence-rounds to commit
    policy_measured_tokens: int = 0  # and what they committed
    policy_shadow_drafts: int = 0  # shadow drafts scored in hindsight (never verified)
    policy_shadow_kept_tokens: int = 0  # and their tokens that would have been kept

    @classmethod
    def total(cls, snapshots: list[ReplicaSnapshot]) -> ReplicaSnapshot:
        """Every counter summed over `snapshots` (per-position counts position by position)."""
        return _total(cls(replica="*"), snapshots)


@dataclass(frozen=True)
class DraftAnnouncement:
    """A draft replica's heartbeat: where its gRPC server listens, and its counters so far."""

    address: str  # host:port of the replica's gRPC draft server
    replica: str
    trees_sent: int = 0
    cache_hits: int = 0  # rounds answered from the speculation cache
    cache_lookups: int = 0  # rounds that looked in it
    cache_saved_s: float = 0.0  # drafting time the hits saved
    trees_pushed: int = 0  # pre-drafted trees pushed ahead of their round
    batches: int = 0  # propose() calls
    drafting_s: float = 0.0  # time inside propose()
    trees_by_target: tuple[tuple[str, int], ...] = ()  # (target application, trees sent to it), sorted

    @classmethod
    def total(cls, announcements: list[DraftAnnouncement]) -> DraftAnnouncement:
        """Every counter summed over `announcements`."""
        return _total(cls(address="*", replica="*"), announcements)


def by_target(announcements: list[DraftAnnouncement]) -> dict[str, int]:
    """Trees sent per target application, summed over draft replicas."""
    sums: dict[str, int] = {}
    for announcement in announcements:
        for target, trees in announcement.trees_by_target:
            sums[target] = sums.get(target, 0) + trees
    return sums


def _total(zero, items: list):
    """`zero` with each numeric field replaced by its sum over `items` (tuples summed per index)."""
    sums = {}
    for f in fields(zero):
        value = getattr(zero, f.name)
        if isinstance(value, str) or f.name.endswith("_by_target"):  # labelled: see `by_target`
            continue
        if isinstance(value, tuple):
            per_index: list[int] = []
            for item in items:
                counts = getattr(item, f.name)
                per_index.extend([0] * (len(counts) - len(per_index)))
                for i, n in enumerate(counts):
                    per_index[i] += n
            sums[f.name] = tuple(per_index)
        else:
            sums[f.name] = sum((getattr(item, f.name) for item in items), value)
    return replace(zero, **sums)
