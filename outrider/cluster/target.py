"""The target deployment: a thin shim over `target_worker.engine.Engine`.

Each replica's four jobs (docs/architecture.md, "How the code reads"; the engine does the decoding):

1. build the runner: one process, or a tensor-parallel group whose ranks 1.. are shard
   actors in the replica's placement group (`cluster.tp_shards`), rank 0 being this process;
2. build the draft source the config names: none (`no_speculation`), a proposer in this
   process, or the gRPC client pointed at the draft deployment's replicas or at external
   `draft_endpoints`;
3. run the engine's step loop on a thread (`EngineLoop`) and stream each request's token
   deltas back to the ingress as a Serve streaming response;
4. report its counters (`stats`, and with each finished request) for `/metrics`.

Stream protocol with the ingress (`cluster.messages`): a `GenerateRequest` in; out, an
admitted `StreamChunk` first (so overload is known before the HTTP status is sent), then
chunks of token ids; the last one has a finish reason and this replica's `ReplicaSnapshot`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from ray import serve

from outrider.cluster.config import OutriderArgs, load_args, parse_speculative
from outrider.cluster.draft_registry import DraftPoolWatcher
from outrider.cluster.engine_loop import EngineLoop
from outrider.cluster.messages import GenerateRequest, ReplicaSnapshot, StreamChunk
from outrider.cluster.served_model import ServedModel
from outrider.proto import TreeBudget
from outrider.proto.gc_heap import freeze_gc_heap
from outrider.target_worker.draft_source import DraftSource

log = logging.getLogger(__name__)


@serve.deployment(name="TargetWorker", health_check_period_s=10, graceful_shutdown_timeout_s=20)
class TargetWorker:
    def __init__(self, model: ServedModel, args: dict[str, Any], drafts=None, seed_key: bytes | None = None):
        """`drafts`: the draft deployment's handle when there is one (its replicas are found by
        registry). `seed_key`: the application's secret for seeded requests, the same in every
        replica (`EngineArgs.seed_key`); None draws one for this replica alone."""
        import torch

        from outrider.target_worker.engine import Engine
        from outrider.target_worker.grammar import GrammarBackend

        self.model, self.args = model, load_args(args)
        engine_args = self.args.engine
        if engine_args.num_threads:
            torch.set_num_threads(engine_args.num_threads)
        self.shards = None
        runner = self._build_runner()
        context = serve.get_replica_context()
        self.draft_source = build_draft_source(self.args, model, runner, context.app_name)
        ceiling, budget_policy = round_ceiling(self.args, model)
        self.engine = Engine(
            runner,
            self.draft_source,
            eos_token_id=model.eos_token_ids,
            max_batch=engine_args.max_num_seqs,
            tree_budget=ceiling,
            budget_policy=budget_policy,
            draft_timeout_s=self.args.draft_pool.round_deadline_ms / 1000,
            seed_key=seed_key or engine_args.seed_key(),
            block_size=engine_args.block_size,
            prefix_caching=engine_args.enable_prefix_caching,
            grammars=GrammarBackend(model.tokenizer_dir, model.vocab_size, model.eos_token_ids),
        )
        self.loop = EngineLoop(self.engine, engine_args.max_num_seqs, engine_args.max_queued_requests)
        self.replica = context.replica_id.unique_id
        freeze_gc_heap("target replica")  # start-up done: full collections skip all it made

    def _build_runner(self):
        from outrider.target_worker.runner import ModelRunner

        limits = self.args.engine
        rows = limits.kv_cache_rows or limits.max_num_seqs * self.model.max_model_len
        if self.args.tensor_parallel_size == 1:
            from outrider.cluster.tp_shards import default_device

            return ModelRunner.from_pretrained(
                self.model.target_dir,
                max_model_len=self.model.max_model_len,
                kv_cache_rows=rows,
                device=default_device(),
            )
        from outrider.cluster.tp_shards import TPShards, default_device

        gpus = self.args.target.gpus_per_rank if default_device() == "cuda" else 0.0
        self.shards = TPShards(self.model, self.args.tensor_parallel_size, rows, gpus)
        return self.shards.leader_runner()

    # ------------------------------------------------------------------ requests

    async def generate(self, request: GenerateRequest) -> AsyncIterator[StreamChunk]:
        if request.params.grammar is not None:  # compiled (and cached) here, not on the step thread
            await asyncio.to_thread(self.engine.grammars.compile, request.params.grammar)
        request_id, queue = self.loop.submit(  # may raise 429
            list(request.prompt_token_ids), request.params, list(request.output_token_ids)
        )
        yield StreamChunk(admitted=True)
        finished = False
        try:
            while not finished:
                output = await queue.get()
                if isinstance(output, BaseException):
                    raise output
                finished = output.finished
                yield StreamChunk(
                    token_ids=tuple(output.new_token_ids),
                    finish_reason=output.finish_reason,
                    snapshot=self._snapshot() if finished else None,
                    logprobs=None if output.logprobs is None else tuple(output.logprobs),
                    prompt_logprobs=None if output.prompt_logprobs is None else tuple(output.prompt_logprobs),
                )
        finally:
            if not finished:  # cancelled by the ingress (client gone, stop string hit)
                self.loop.abort(request_id)

    async def stats(self) -> ReplicaSnapshot:
        return self._snapshot()

    async def ping(self) -> bool:
        return self.loop.error is None

    def check_health(self) -> None:
        if self.loop.error is not None:
            raise RuntimeError(f"the engine step loop died: {self.loop.error!r}")

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Batch occupancy, for a policy that scales targets on it (the default uses requests in flight)."""
        return {"batch_occupancy": self.loop.num_running / self.args.engine.max_num_seqs}

    def _snapshot(self) -> ReplicaSnapshot:
        stats, spec, drafts = self.engine.stats, self.engine.stats.spec, self.draft_source
        client = drafts.client_counters if drafts is not None else None
        return ReplicaSnapshot(
            replica=self.replica,
            num_drafts=spec.num_drafts,
            num_draft_tokens=spec.num_draft_tokens,
            num_accepted_tokens=spec.num_accepted_tokens,
            num_accepted_tokens_per_pos=tuple(spec.num_accepted_tokens_per_pos),
            steps=stats.num_rounds,
            trees_missing=stats.num_missing_trees,
            **_kv_fields(self.engine, self.loop.num_waiting),
            max_num_seqs=self.args.engine.max_num_seqs,
            batch_seq_sum=self.loop.stats.batch_seq_sum,
            draft_round_trips=drafts.collects if drafts is not None else 0,
            draft_round_trip_s=drafts.collect_s if drafts is not None else 0.0,
            trees_late=client.trees_late if client is not None else 0,
            trees_invalid=client.trees_invalid if client is not None else 0,
            **_trust_fields(self.engine.trust),
            **_policy_fields(self.engine.policy),
        )

    def __del__(self) -> None:
        loop = getattr(self, "loop", None)
        if loop is not None:
            loop.stop()
        if getattr(self, "draft_source", None) is not None:
            self.draft_source.close()
        if getattr(self, "shards", None) is not None:
            self.shards.shutdown()


def _kv_fields(engine, loop_waiting: int) -> dict[str, Any]:
    """The batch and the paged KV cache as vLLM counts them: `running` is the engine's batch,
    `waiting` what is queued in front of it (in the replica's loop and in the engine)."""
    blocks = engine.blocks
    return dict(
        running=len(engine.running),
        waiting=loop_waiting + len(engine.waiting),
        kv_blocks_used=blocks.num_blocks - blocks.num_free_blocks,
        kv_blocks_total=blocks.num_blocks,
        prefix_cache_queries=blocks.stats.queries,
        prefix_cache_hits=blocks.stats.hits,
        num_preemptions=engine.stats.num_preemptions,
    )


def _trust_fields(trust) -> dict[str, Any]:
    """The snapshot's view of `engine.trust` (None without speculation)."""
    if trust is None:
        return {}
    return dict(
        draft_verification=trust.mode.value,
        trees_demoted=trust.demoted_trees,
        audited_children=trust.audited_children,
        audit_ratio_sum=trust.ratio_sum,
    )


def _policy_fields(policy) -> dict[str, Any]:
    """The snapshot's view of `engine.policy` (None without speculation)."""
    if policy is None:
        return {}
    return dict(
        budget_depths=tuple(policy.stats.depth_counts),
        policy_predicted_tokens=policy.stats.predicted_tokens,
        policy_measured_tokens=policy.stats.measured_tokens,
        policy_shadow_drafts=policy.stats.shadow_drafts,
        policy_shadow_kept_tokens=policy.stats.shadow_kept,
    )


class TimedDraftSource(DraftSource):
    """Any draft source, with the time the engine spends waiting in `collect` (the round trip).

    `client_counters`: the gRPC client's counters, for the snapshot (None in-process);
    `watcher`: what keeps the client's addresses current, stopped with the source.
    """

    def __init__(self, inner: DraftSource, client_counters=None, watcher: DraftPoolWatcher | None = None):
        self.inner, self.client_counters, self.watcher = inner, client_counters, watcher
        self.collects, self.collect_s = 0, 0.0
        self.validates_trees, self.trusts_q = inner.validates_trees, inner.trusts_q
        self.overlaps_drafting = inner.overlaps_drafting  # the engine's lanes need to know

    @property
    def feature_spec(self):
        return self.inner.feature_spec

    @property
    def label(self) -> str:
        return self.inner.label

    def submit(self, updates) -> None:
        self.inner.submit(updates)

    def collect(self, seq_ids, timeout_s=None):
        start = time.perf_counter()
        try:
            return self.inner.collect(seq_ids, timeout_s)
        finally:
            self.collects += 1
            self.collect_s += time.perf_counter() - start

    def feature_projection(self):
        return self.inner.feature_projection()

    def close(self) -> None:
        if self.watcher is not None:
            self.watcher.stop()
        self.inner.close()


def speculative_for(args: OutriderArgs, model: ServedModel) -> dict[str, Any] | None:
    """The speculative config in force; model-based methods default to the demo family's own
    drafter for them: its draft LM for draft_model, its trained head for eagle3, medusa, ..."""
    spec = args.speculative
    if spec is None or "model" in spec:
        return spec
    if spec["method"] == "draft_model" and model.draft_dir:
        return {**spec, "model": model.draft_dir}
    if model.head_dir:
        return {**spec, "model": model.head_dir}
    return spec


def round_ceiling(args: OutriderArgs, model: ServedModel) -> tuple[TreeBudget, str]:
    """The most any sequence drafts per round (the deployment's `tree_budget` limit, within the
    drafter's own tree keys: `num_speculative_tokens` is the depth ceiling), and the budget policy."""
    limit, spec = args.tree_budget_limit, speculative_for(args, model)
    if spec is None:
        return limit, "fixed"
    drafter = parse_speculative(spec)
    own = drafter.budget
    ceiling = TreeBudget(
        max_nodes=min(limit.max_nodes, own.max_nodes),
        max_depth=min(limit.max_depth, own.max_depth),
        top_k=min(limit.top_k, own.top_k),
        q_width=min(limit.q_width, own.q_width),
    )
    return ceiling, drafter.budget_policy


def build_draft_source(args: OutriderArgs, model: ServedModel, runner, app_name: str):
    spec = speculative_for(args, model)
    if spec is None:
        return None
    pool = args.draft_pool
    if pool.mode == "colocated":
        from outrider import draft_worker  # noqa: F401 - registers the built-in methods
        from outrider.draft_worker.proposer import build_proposer
        from outrider.target_worker.draft_source import InProcessDraftSource

        # Sized for every sequence the engine runs at once (at least the default 32: a finished
        # sequence's state may outlive it by a round): at a fixed 32, a draft model at
        # concurrency 64 drafted nothing for a third of the sequences it was asked for.
        capacity = max(32, args.engine.max_num_seqs)
        proposer = build_proposer(
            spec, vocab_size=model.vocab_size, device=runner.device, max_sequences=capacity
        )
        return TimedDraftSource(InProcessDraftSource(proposer))
    from outrider.cluster.draft_registry import wait_for_draft_endpoints
    from outrider.proto import HandshakeRequest, Limits
    from outrider.target_worker.draft_client import (
        DraftClientConfig,
        RemoteDraftSource,
        tokenizer_fingerprint,
    )

    # Whose registry lists the pool: this application's, or the one it shares (mode "shared").
    pool_app = pool.shared_app or app_name
    addresses = pool.draft_endpoints if pool.mode == "external" else wait_for_draft_endpoints(pool_app)
    budget = args.tree_budget_limit
    handshake = HandshakeRequest(
        target_model_id=model.name,
        vocab_size=model.vocab_size,
        vocab_fingerprint=tokenizer_fingerprint(model.tokenizer_dir),
        target_num_layers=runner.model.num_layers,
        target_hidden_size=runner.model.hidden_size,
        limits=Limits(
            max_batch=args.engine.max_num_seqs,
            max_nodes=budget.max_nodes,
            max_depth=budget.max_depth,
            max_top_k=budget.top_k,
            max_q_width=budget.q_width,
        ),
        method=spec["method"],
    )
    tls, token = pool.client_security()
    source = RemoteDraftSource(
        addresses,
        handshake,
        DraftClientConfig(
            round_deadline_s=pool.round_deadline_ms / 1000,
            tls=tls,
            token=token,
            trust_q=pool.trusts_drafts,
            target_label=app_name,  # the draft servers count rounds per target application
        ),
    )
    if not source.wait_ready(timeout_s=60):
        log.warning("no draft worker reachable at %s yet; decoding without drafts until one is", addresses)
    # The deployment's replicas come and go with autoscaling; external addresses are fixed.
    watcher = DraftPoolWatcher(source, addresses, pool_app) if pool.mode != "external" else None
    return TimedDraftSource(source, client_counters=source.counters, watcher=watcher)
