"""The target deployment: a thin shim over `target_worker.engine.Engine`.

Each replica's four jobs (STYLE.md rule 12; the engine does the decoding):

1. build the runner: one process, or a tensor-parallel group whose ranks 1.. are shard
   actors in the replica's placement group (`cluster.tp_shards`), rank 0 being this process;
2. build the draft source the config names: none (`no_speculation`), a proposer in this
   process, or the gRPC client pointed at the draft deployment's replicas or at external
   `draft_endpoints`;
3. run the engine's step loop on a thread (`EngineLoop`) and stream each request's token
   deltas back to the ingress as a Serve streaming response;
4. report its counters (`stats`, and with each finished request) for `/metrics`.

Stream protocol with the ingress: `{"admitted": True}` first (so overload is known before
the HTTP status is sent), then `{"token_ids": [...], "finish_reason": None | "stop" | ...}`
chunks; the last one also carries this replica's counters snapshot.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from ray import serve

from outrider.cluster.config import OutriderArgs, load_args
from outrider.cluster.engine_loop import EngineLoop
from outrider.cluster.served_model import ServedModel
from outrider.target_worker.draft_source import DraftSource

log = logging.getLogger(__name__)


@serve.deployment(name="TargetWorker", health_check_period_s=10, graceful_shutdown_timeout_s=20)
class TargetWorker:
    def __init__(self, model: ServedModel, args: dict[str, Any], drafts=None):
        """`drafts`: the draft deployment's handle when there is one (its replicas are found by registry)."""
        import torch

        from outrider.proto import DEFAULT_TREE_BUDGET, TreeBudget
        from outrider.target_worker.engine import Engine

        self.model, self.args = model, load_args(args)
        engine_args = self.args.engine
        if engine_args.num_threads:
            torch.set_num_threads(engine_args.num_threads)
        self.shards = None
        runner = self._build_runner()
        context = serve.get_replica_context()
        self.draft_source = build_draft_source(self.args, model, runner, context.app_name)
        budget = self.args.tree_budget
        self.engine = Engine(
            runner,
            self.draft_source,
            eos_token_id=model.eos_token_id,
            max_batch=engine_args.max_num_seqs,
            tree_budget=TreeBudget(budget.max_nodes, budget.max_depth, budget.top_k, budget.q_width)
            if budget
            else DEFAULT_TREE_BUDGET,
            draft_timeout_s=self.args.draft_pool.round_deadline_ms / 1000,
        )
        self.loop = EngineLoop(self.engine, engine_args.max_num_seqs, engine_args.max_queued_requests)
        self.replica = context.replica_id.unique_id

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

    async def generate(self, request: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        from outrider.target_worker.sequence import RequestParams

        sampling = request.get("sampling", {})
        params = RequestParams(
            max_tokens=int(request["max_tokens"]),
            temperature=float(sampling.get("temperature", 0.0)),
            top_k=int(sampling.get("top_k", 0)),
            top_p=float(sampling.get("top_p", 1.0)),
            seed=sampling.get("seed"),
        )
        request_id, queue = self.loop.submit(list(request["prompt_token_ids"]), params)  # may raise 429
        yield {"admitted": True, "token_ids": []}
        finished = False
        try:
            while not finished:
                output = await queue.get()
                if isinstance(output, BaseException):
                    raise output
                finished = output.finished
                chunk = {"token_ids": output.new_token_ids, "finish_reason": output.finish_reason}
                if finished:
                    chunk["snapshot"] = self._snapshot()
                yield chunk
        finally:
            if not finished:  # cancelled by the ingress (client gone, stop string hit)
                self.loop.abort(request_id)

    async def stats(self) -> dict[str, Any]:
        return self._snapshot()

    async def ping(self) -> bool:
        return self.loop.error is None

    def check_health(self) -> None:
        if self.loop.error is not None:
            raise RuntimeError(f"the engine step loop died: {self.loop.error!r}")

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Batch occupancy, for a policy that scales targets on it (the default uses requests in flight)."""
        return {"batch_occupancy": self.loop.num_running / self.args.engine.max_num_seqs}

    def _snapshot(self) -> dict[str, Any]:
        stats, spec = self.engine.stats, self.engine.stats.spec
        snap = {
            "replica": self.replica,
            "num_drafts": spec.num_drafts,
            "num_draft_tokens": spec.num_draft_tokens,
            "num_accepted_tokens": spec.num_accepted_tokens,
            "num_accepted_tokens_per_pos": list(spec.num_accepted_tokens_per_pos),
            "steps": stats.num_rounds,
            "trees_missing": stats.num_missing_trees,
            "running": self.loop.num_running,
            "waiting": self.loop.num_waiting,
            "max_num_seqs": self.args.engine.max_num_seqs,
            "batch_seq_sum": self.loop.stats.batch_seq_sum,
        }
        if self.draft_source is not None:
            snap["draft_round_trips"] = self.draft_source.collects
            snap["draft_round_trip_s"] = self.draft_source.collect_s
        counters = getattr(self.draft_source, "inner", None) and getattr(
            self.draft_source.inner, "counters", None
        )
        if counters is not None:
            snap["trees_late"] = counters.trees_late
            snap["trees_invalid"] = counters.trees_invalid
        return snap

    def __del__(self) -> None:
        loop = getattr(self, "loop", None)
        if loop is not None:
            loop.stop()
        if getattr(self, "draft_source", None) is not None:
            if getattr(self.draft_source, "watcher", None) is not None:
                self.draft_source.watcher.stop()
            self.draft_source.close()
        if getattr(self, "shards", None) is not None:
            self.shards.shutdown()


class TimedDraftSource(DraftSource):
    """Any draft source, with the time the engine spends waiting in `collect` (the round trip)."""

    def __init__(self, inner):
        self.inner, self.collects, self.collect_s = inner, 0, 0.0
        self.validates_trees = inner.validates_trees

    @property
    def feature_spec(self):
        return self.inner.feature_spec

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
        self.inner.close()


class DraftPoolWatcher:
    """Keeps a RemoteDraftSource's addresses in step with the draft deployment's replicas.

    Draft replicas announce themselves in Ray's internal KV (`cluster.draft`); when Serve
    scales the draft deployment up or down, the set of fresh announcements changes and the
    client follows it (`RemoteDraftSource.set_endpoints`): new replicas get sequences, the
    sequences of a departed one move with their whole context.
    """

    def __init__(self, source, app_name: str, period_s: float = 2.0):
        import threading

        self.source, self.app_name, self.period_s = source, app_name, period_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="draft-pool-watcher", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        from outrider.cluster.draft import draft_endpoints

        while not self._stop.wait(self.period_s):
            try:
                found = draft_endpoints(self.app_name)
            except Exception as error:  # the GCS can blip; the last known pool stays in use
                log.debug("draft registry unreadable: %s", error)
                continue
            current = [e.address for e in self.source.endpoints]
            if found and sorted(found) != sorted(current):
                log.info("draft pool changed: %s -> %s", current, found)
                self.source.set_endpoints(found)

    def stop(self) -> None:
        self._stop.set()


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


def build_draft_source(args: OutriderArgs, model: ServedModel, runner, app_name: str):
    spec = speculative_for(args, model)
    if spec is None:
        return None
    pool = args.draft_pool
    if pool.mode == "colocated":
        from outrider import draft_worker  # noqa: F401 - registers the built-in methods
        from outrider.draft_worker.proposer import build_proposer
        from outrider.target_worker.draft_source import InProcessDraftSource

        proposer = build_proposer(spec, vocab_size=model.vocab_size, device=runner.device)
        return TimedDraftSource(InProcessDraftSource(proposer))
    from outrider.cluster.draft import wait_for_draft_endpoints
    from outrider.proto import HandshakeRequest, Limits
    from outrider.target_worker.draft_client import (
        DraftClientConfig,
        RemoteDraftSource,
        tokenizer_fingerprint,
    )

    addresses = pool.draft_endpoints if pool.mode == "external" else wait_for_draft_endpoints(app_name)
    budget = args.tree_budget
    handshake = HandshakeRequest(
        target_model_id=model.name,
        vocab_size=model.vocab_size,
        vocab_fingerprint=tokenizer_fingerprint(model.tokenizer_dir),
        target_num_layers=runner.model.num_layers,
        target_hidden_size=runner.model.hidden_size,
        limits=Limits(
            max_batch=args.engine.max_num_seqs,
            max_nodes=budget.max_nodes if budget else 32,
            max_depth=budget.max_depth if budget else 8,
            max_top_k=budget.top_k if budget else 8,
            max_q_width=budget.q_width if budget else 32,
        ),
        method=spec["method"],
    )
    tls, token = pool.client_security()
    source = RemoteDraftSource(
        addresses,
        handshake,
        DraftClientConfig(round_deadline_s=pool.round_deadline_ms / 1000, tls=tls, token=token),
    )
    if not source.wait_ready(timeout_s=60):
        log.warning("no draft worker reachable at %s yet; decoding without drafts until one is", addresses)
    timed = TimedDraftSource(source)
    if pool.mode != "external":  # the deployment's replicas come and go with autoscaling
        timed.watcher = DraftPoolWatcher(source, app_name)
    return timed
