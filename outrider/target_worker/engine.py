"""The step engine: continuous batching of requests over one runner, one round per `step()`.

A round (docs/architecture.md, "One round"; docs/algorithms.md sections 1-2), as `step` reads:

    trees = drafts.collect(...)             # one per decoding sequence; untrusted, so checked,
                                            #   and demoted unless the source's q is trusted
    out = runner.forward(...)               # new prompts' chunks + every tree, one ragged batch
    logits = apply_logits_processors(...)   # penalties, bias, grammar: each node with its path
    res = verify(trees, p, greedy, rand)    # lossless; greedy and sampled rows together
    trust.audit(trees, p)                   # a trusted source's q, checked against p (draft_trust)
    cache.compact(...)                      # the accepted paths' K/V follow their roots
    ... append, stop, free, stream          # the caller gets per-request token deltas
    drafts.submit(deltas)                   # drafting of the next round overlaps the caller

With a draft source that drafts elsewhere while the engine works (`overlaps_drafting`: the
gRPC client), the decoding sequences are split into two lanes that take turns, so the target
never idles while the drafter drafts, and vice versa:

    step k:    verify lane A  |  drafter drafts lane B's trees
    step k+1:  verify lane B  |  drafter drafts lane A's trees

Each round (one step, one verify forward) then verifies about half the batch; every sequence
gets its turn in two half-size forwards instead of one forward plus the drafting of the whole
batch. Whether that pays depends on how long drafting takes next to verifying, so by default
the engine measures both modes as it runs and uses the faster (`target_worker.lanes.LaneTuner`).
One decoding sequence has nothing to overlap with, and in-process drafting runs inside
`collect`, so both keep one lane (the speculation cache is what hides the drafter at batch 1);
so does a step where the policy asked no sequence to draft (speculation off: two half-batch
forwards would only cost more), and such steps say nothing to the lane tuner.

A sequence without a tree (speculation off, no tree by the deadline, a bad tree) is verified
with a root-only tree: plain decoding of one token through the same code path. The KV cache
is paged (`block_manager`): requests are admitted while a batch slot and their prompt's
blocks are free, sequences take blocks as they grow, and when blocks run out the youngest is
preempted and later recomputed (`kv_scheduler`); a request that could never fit is refused
at `add_request` with `CacheFullError`. The features a drafter needs are captured in the same
forward (`target_worker.drafter_features`).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch

from outrider.kernels import SpecDecodeCounters, verify
from outrider.proto import DEFAULT_TREE_BUDGET, CandidateTree, FeatureSpec, SequenceUpdate, TreeBudget
from outrider.target_worker.block_manager import BlockManager
from outrider.target_worker.draft_source import DraftSource
from outrider.target_worker.draft_trust import PROCESS_SEED_KEY, DraftTrust, derive_seed
from outrider.target_worker.drafter_features import capture_for, features_to_send, gather_features
from outrider.target_worker.kv_cache import CacheFullError
from outrider.target_worker.kv_scheduler import KVScheduler
from outrider.target_worker.lanes import LaneTuner, lane_to_verify
from outrider.target_worker.logits_processors import apply_logits_processors
from outrider.target_worker.round_outputs import (
    append_outputs,
    fill_prompts,
    record_prompt_logprobs,
    stop_ids_for,
)
from outrider.target_worker.round_plan import RoundPlan, checked_trees, plan_round
from outrider.target_worker.runner import ModelRunner
from outrider.target_worker.sequence import RequestOutput, RequestParams, Sequence
from outrider.target_worker.spec_policy import NO_DRAFT, PolicyConfig, SpeculationPolicy
from outrider.target_worker.verify_inputs import greedy_rows, target_probs, verify_randoms

if TYPE_CHECKING:  # xgrammar is imported only where structured output is served
    from outrider.target_worker.grammar import GrammarBackend

log = logging.getLogger(__name__)

_FINISHED_BUDGET = TreeBudget(max_nodes=1, max_depth=0, top_k=0)


@dataclass
class EngineStats:
    """Counters for benchmarks: vLLM's spec-decode metrics plus the engine's own."""

    spec: SpecDecodeCounters = field(default_factory=SpecDecodeCounters)
    num_rounds: int = 0  # target forwards (one per step)
    num_output_tokens: int = 0  # tokens streamed to callers
    num_prefill_tokens: int = 0
    num_trees: int = 0  # valid trees used
    num_invalid_trees: int = 0  # dropped: malformed, over budget, wrong root or round
    num_missing_trees: int = 0  # no tree by the deadline
    num_preemptions: int = 0  # sequences whose blocks were taken back, to be recomputed


@dataclass
class Completion:
    """What `generate` returns per prompt."""

    token_ids: list[int]
    finish_reason: str
    stop_reason: str | int | None
    text: str | None


class Engine:
    def __init__(
        self,
        runner: ModelRunner,
        draft_source: DraftSource | None = None,
        *,
        eos_token_id: int | Iterable[int] | None,
        max_batch: int = 16,
        tree_budget: TreeBudget = DEFAULT_TREE_BUDGET,
        max_prefill_tokens: int = 512,
        draft_timeout_s: float | None = None,
        detokenize: Callable[[list[int]], str] | None = None,
        lanes: int | None = None,
        seed_key: bytes = PROCESS_SEED_KEY,
        budget_policy: str = "fixed",
        block_size: int = 16,
        prefix_caching: bool = True,
        grammars: GrammarBackend | None = None,
    ):
        """`draft_source` None = speculation off. `detokenize` is needed for stop strings,
        `grammars` for structured output. `eos_token_id`: one id or several; any of them stops.

        `seed_key`: the secret from which a seeded request's verification randomness and its
        drafter's seed are derived apart (`draft_trust.derive_seed`): a drafter that knows the
        request's seed still cannot predict the verifier's uniforms.

        `budget_policy`: "adaptive" lets `spec_policy.SpeculationPolicy` choose each sequence's
        draft depth every round (0: no draft); "fixed" drafts `tree_budget` every round (vLLM's
        fixed K). The served default is adaptive (`speculative_config.budget_policy`).

        `lanes`: 2 alternates halves of the batch so remote drafting overlaps verification
        (module docstring); None = for a source that `overlaps_drafting`, 1 or 2 by measured
        throughput (`LaneTuner`), else 1.

        `block_size`: KV slots per cache block. `prefix_caching`: share full blocks of equal
        prompt prefixes between requests; off (with a log line) for drafters that need target
        features, which a skipped prefill would not produce.
        """
        if max_prefill_tokens < 1 or max_batch < 1:
            raise ValueError("max_batch and max_prefill_tokens must be >= 1")
        self.lane_tuner = None
        if lanes is None:
            overlaps = draft_source is not None and draft_source.overlaps_drafting
            self.lane_tuner = LaneTuner() if overlaps else None
            lanes = self.lane_tuner.mode if overlaps else 1
        if lanes not in (1, 2):
            raise ValueError(f"lanes must be 1 or 2, got {lanes}")
        self.runner, self.cache, self.drafts = runner, runner.cache, draft_source
        eos = (
            [] if eos_token_id is None else [eos_token_id] if isinstance(eos_token_id, int) else eos_token_id
        )
        self.eos_token_ids, self.grammars = frozenset(int(t) for t in eos), grammars
        self.max_batch, self.tree_budget = max_batch, tree_budget
        self.max_prefill_tokens, self.draft_timeout_s = max_prefill_tokens, draft_timeout_s
        self.detokenize, self.vocab_size = detokenize, runner.model.vocab_size
        self.features = draft_source.feature_spec if draft_source else FeatureSpec()
        self.capture = capture_for(self.features, runner.model.num_layers)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.round = 0
        self.lanes, self._turn = lanes, 0  # the lane the next step verifies
        self.stats = EngineStats()
        self._next_id = 0
        self.seed_key = seed_key
        self._submit_s = 0.0  # the last step's `_submit_deltas` time, charged to the next round
        self._missing = 0  # asked trees not in by the last collect's deadline (`_checked_trees`)
        if prefix_caching and self.capture is not None:
            log.info("prefix caching is off: the drafter needs the target's features of every prompt token")
        self.blocks = BlockManager(
            self.cache.total_rows // block_size, block_size, prefix_caching and self.capture is None
        )
        self.kv = KVScheduler(self.blocks, self._max_rows(), max_batch, self._on_admit)
        if budget_policy not in ("adaptive", "fixed"):
            raise ValueError(f"budget_policy must be 'adaptive' or 'fixed', got {budget_policy!r}")
        adaptive = PolicyConfig(adaptive=budget_policy == "adaptive")
        self.policy = SpeculationPolicy(tree_budget, adaptive) if draft_source else None
        # Whose q the verifier may use: the source's own declaration, made by the operator.
        self.trust = DraftTrust(draft_source.trusts_q, draft_source.label) if draft_source else None

    # ---- requests ------------------------------------------------------------------------

    def add_request(
        self,
        prompt_token_ids: Iterable[int],
        params: RequestParams | None = None,
        output_token_ids: Iterable[int] = (),
    ) -> int:
        """Queues a request; returns its id. CacheFullError if it could never fit.

        `output_token_ids`: tokens this request already produced elsewhere (a choice resumed
        after its replica died): it continues after them as after its own output, so
        penalties count them, the grammar has consumed them and max/min_tokens include them."""
        params = params or RequestParams()
        prompt = [int(t) for t in prompt_token_ids]
        done = [int(t) for t in output_token_ids]
        if not all(0 <= t < self.vocab_size for t in done) or len(done) >= params.max_tokens:
            raise ValueError(f"output_token_ids must be fewer than max_tokens and in [0, {self.vocab_size})")
        if not prompt:
            raise ValueError("a prompt needs at least one token")
        if not all(0 <= t < self.vocab_size for t in prompt):
            raise ValueError(f"prompt tokens must be in [0, {self.vocab_size})")
        if params.stop and self.detokenize is None:
            raise ValueError("stop strings need an engine built with `detokenize`")
        if params.grammar is not None and self.grammars is None:
            raise ValueError("structured output needs an engine built with `grammars`")
        named = [t for t, _ in params.logit_bias] + list(params.stop_token_ids)
        if not all(0 <= t < self.vocab_size for t in named):
            raise ValueError(f"logit_bias and stop_token_ids must be token ids in [0, {self.vocab_size})")
        need, most = self._rows_needed(len(prompt), params), self._max_rows()
        if need > most:
            raise CacheFullError(
                f"request needs {need} KV rows (prompt {len(prompt)} + max_tokens {params.max_tokens} - 1); "
                f"a sequence can hold at most {most} (max_model_len {self.runner.max_model_len}, "
                f"KV cache {self.blocks.num_blocks * self.blocks.block_size} slots)"
            )
        generator, draft_sampling = None, params.sampling
        if params.seed is not None:
            verify_seed = derive_seed(self.seed_key, params.seed, "verify")
            generator = torch.Generator(self.runner.device).manual_seed(verify_seed)
            draft_sampling = replace(draft_sampling, seed=derive_seed(self.seed_key, params.seed, "draft"))
        seq = Sequence(self._next_id, params, prompt + done, len(prompt), generator, draft_sampling)
        seq.stop_ids = stop_ids_for(params, self.eos_token_ids)
        seq.grammar = self.grammars.matcher(params.grammar) if params.grammar is not None else None
        for token in done if seq.grammar is not None else ():
            seq.grammar.accept_token(token)
        if done and params.stop:
            seq.text = self.detokenize(done)
        self._next_id += 1
        self.waiting.append(seq)
        return seq.seq_id

    def abort_request(self, request_id: int) -> None:
        for seq in [*self.waiting, *self.running]:
            if seq.seq_id == request_id and not seq.finished:
                seq.finish_reason = "abort"
                self._release([seq])
                if self.policy is not None:
                    self.policy.forget(seq.seq_id)
                if self.drafts is not None and seq.num_sent:
                    self.drafts.submit([self._delta(seq, _FINISHED_BUDGET, None, finished=True)])

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- the round -----------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One round (one verify forward: every running sequence, or with two lanes the decoding
        ones of the lane whose turn it is); returns what each gained (token deltas)."""
        self._admit()
        if not self.running:
            return []
        self.round += 1
        started = time.perf_counter()
        if self.lane_tuner is not None:
            self.lanes = self.lane_tuner.mode
        decoding = [s for s in self.running if not s.prefilling]
        ready, drafting = decoding, any(s.asked for s in decoding)
        if self.lanes == 2 and drafting:  # (no drafts anywhere: nothing to overlap, one forward)
            ready, self._turn = lane_to_verify(decoding, self._turn)
        # 1. Draft: trees for the sequences the policy asked to draft; the others, and missing
        #    or bad trees, become root-only.
        asked = [s.seq_id for s in ready if s.asked]
        trees = self.drafts.collect(asked, self.draft_timeout_s) if asked else {}
        collected = time.perf_counter()
        trees = self._checked_trees(ready, trees)
        ready, trees = self.kv.reserve(ready, trees, self.running, self.waiting, self.round)
        prefilling = [s for s in self.running if s.prefilling]
        if not ready and not prefilling:  # all preempted: the next step readmits them
            return []
        plan = plan_round(
            list(zip(ready, trees, strict=True)),
            prefilling,
            self.max_prefill_tokens,
            self.round,
            self.capture,
            self.runner.device,
            self.blocks.block_size,
        )
        # 2. One target forward: prompt chunks and every tree, flattened into one ragged batch.
        forwarding = time.perf_counter()
        out = self.runner.forward(plan.forward)
        features = gather_features(out, self.features, self.runner.model.num_layers) if self.capture else None
        self._count(plan)
        record_prompt_logprobs(plan, out.logits)  # echo's prompt logprobs, before the chunks are filled
        outputs = []
        if plan.trees is not None:
            # 3. Verify every tree against p (after each request's temperature/top-k/top-p).
            device = self.runner.device
            logits = apply_logits_processors(plan, out.logits)  # penalties, grammar, ...: per node
            p, greedy = target_probs(plan, logits, device), greedy_rows(plan, device)
            res = verify(plan.trees, p, greedy, verify_randoms(plan, self.vocab_size, device))
            forward_s = time.perf_counter() - forwarding  # (the policy's cost split: `RoundCost`)
            # 4. Commit: the accepted paths' K/V move next to their roots; tokens are appended.
            if plan.slot_map is not None:  # some tree had drafts to accept
                self.trust.audit(plan.trees, p, greedy)  # trusted sampled trees: is q honest?
                self.cache.compact(res.accepted_node_ids, plan.slot_map)
            self.stats.spec.observe(plan.trees.cu_num_draft_tokens, res)
            outputs = append_outputs(plan, res, logits, features, self.detokenize)
            self.stats.num_output_tokens += sum(len(o.new_token_ids) for o in outputs)
            # The round's cost outside collect: this far, plus the last round's deltas (the
            # ones this round's drafting answered), which are sent after the policy learns.
            if self.policy is not None:
                round_s = time.perf_counter() - collected + self._submit_s
                self.policy.observe_round(
                    ready, trees, res, plan, collected - started, round_s, forward_s, self._missing
                )
        fill_prompts(plan, features)
        self.kv.settle(plan.verified, plan.filled)
        # 5. Deltas (under the policy's budgets) for the next round's trees, and `finished`.
        finished = [s for s in self.running if s.finished]
        self._release(finished)
        submitting = time.perf_counter()
        self._submit_deltas(plan.verified, finished)
        self._submit_s = time.perf_counter() - submitting
        if self.lane_tuner is not None and len(decoding) > 1 and drafting and not plan.num_prefill_tokens:
            self.lane_tuner.record(sum(len(o.new_token_ids) for o in outputs), time.perf_counter() - started)
        return outputs

    def stream(self) -> Iterator[RequestOutput]:
        """Steps until every request is done, yielding each round's outputs."""
        while self.has_unfinished():
            yield from self.step()

    def generate(
        self, prompts: list[Iterable[int]], params: RequestParams | list[RequestParams] | None = None
    ) -> list[Completion]:
        """Convenience for tests and scripts: runs the prompts (and whatever else is queued) to the end."""
        per_prompt = params if isinstance(params, list) else [params] * len(prompts)
        ids = [self.add_request(p, q) for p, q in zip(prompts, per_prompt, strict=True)]
        tokens: dict[int, list[int]] = {i: [] for i in ids}
        done: dict[int, RequestOutput] = {}
        while len(done) < len(ids):
            for output in self.step():
                if output.request_id in tokens:
                    tokens[output.request_id] += output.new_token_ids
                    if output.finished:
                        done[output.request_id] = output
        return [Completion(tokens[i], done[i].finish_reason, done[i].stop_reason, done[i].text) for i in ids]

    # ---- admission -----------------------------------------------------------------------

    def _rows_needed(self, num_prompt: int, params: RequestParams) -> int:
        """KV slots for plain decoding: the last output token is never cached."""
        return num_prompt + params.max_tokens - 1

    def _max_rows(self) -> int:
        return min(self.runner.max_model_len, self.blocks.num_blocks * self.blocks.block_size)

    def _admit(self) -> None:
        self.kv.admit(self.waiting, self.running)
        self.stats.num_preemptions = self.kv.num_preemptions

    def _on_admit(self, seq: Sequence) -> None:
        if self.lanes > 1 or self.lane_tuner is not None:  # join the lane with fewer sequences
            sizes = [sum(s.lane == lane for s in self.running) for lane in (0, 1)]
            seq.lane = sizes.index(min(sizes))

    def _release(self, finished: list[Sequence]) -> None:
        for seq in finished:
            if seq in self.running:
                self.running.remove(seq)
                self.kv.release(seq)
            elif seq in self.waiting:
                self.waiting.remove(seq)

    # ---- trees ---------------------------------------------------------------------------

    def _checked_trees(
        self, ready: list[Sequence], received: dict[int, CandidateTree]
    ) -> list[CandidateTree]:
        """The tree each sequence verifies: the drafter's if it is sound, else root-only."""
        validated = self.drafts is not None and self.drafts.validates_trees  # checked on arrival
        trees, good, invalid, missing = checked_trees(ready, received, validated, self.vocab_size, self.round)
        self._missing = missing
        self.stats.num_trees += good
        self.stats.num_invalid_trees += invalid
        self.stats.num_missing_trees += missing
        if not received:  # every tree root-only: nothing to shadow or demote
            return trees
        trees = self.policy.shadow_trees(ready, trees, self.round)  # (unverified)
        return self.trust.prepare(trees)

    def _submit_deltas(self, verified: list[Sequence], finished: list[Sequence]) -> None:
        """Budgets for the sequences verified this step; those given depth > 0 are sent their
        delta. The others are held: the drafter does nothing for them, and gets their tokens
        (one longer delta) when the policy next asks them to draft."""
        if self.drafts is None:
            return
        going = [s for s in verified if s.decoding and not s.finished]
        if self.policy.quiet(len(going), any(len(s.output_ids) == 1 for s in going)):  # off, none due
            for seq in going:
                seq.budget, seq.asked = NO_DRAFT, False
            if finished:
                self._retire(finished, [])
            return
        limits = [s.tree_budget(self.tree_budget) for s in going]
        greedy = [s.params.temperature == 0 for s in going]
        budgets = self.policy.budgets([s.seq_id for s in going], limits, self._next_prefill_tokens(), greedy)
        updates, sent = [], 0
        for seq, budget in zip(going, budgets, strict=True):
            seq.budget, seq.asked = budget, budget.max_depth > 0
            if seq.asked:
                sent += len(seq.tokens) - seq.num_sent
                seq.tree_round = self.round + 1
                features = features_to_send(seq, self.features) if self.capture else None
                updates.append(self._delta(seq, budget, features, finished=False))
        self.policy.sent(sent)
        self._retire(finished, updates)

    def _retire(self, finished: list[Sequence], updates: list[SequenceUpdate]) -> None:
        """Sends `updates` and tells the drafter (and the policy) the finished sequences."""
        for seq in finished:
            self.policy.forget(seq.seq_id, len(seq.tokens) - seq.num_prompt, seq.params.temperature == 0)
        updates += [self._delta(s, _FINISHED_BUDGET, None, finished=True) for s in finished if s.num_sent]
        if updates:
            self.drafts.submit(updates)

    def _next_prefill_tokens(self) -> int:
        """Prompt tokens the next forward will likely carry beside the trees."""
        left = sum(len(s.tokens) - s.num_cached for s in self.running if s.prefilling)
        return min(left, self.max_prefill_tokens)

    def _delta(
        self, seq: Sequence, budget: TreeBudget, features: torch.Tensor | None, finished: bool
    ) -> SequenceUpdate:
        update = SequenceUpdate(
            seq_id=seq.seq_id,
            round=self.round + 1,
            new_tokens=torch.tensor(seq.tokens[seq.num_sent :], dtype=torch.int64),
            sampling=seq.draft_sampling,
            budget=budget,
            features=features,
            finished=finished,
            reset=seq.num_sent == 0,
        )
        seq.num_sent, seq.unsent_features = len(seq.tokens), []
        return update

    # ---- verification and commit ---------------------------------------------------------

    def _count(self, plan: RoundPlan) -> None:
        self.stats.num_rounds += 1
        self.stats.num_prefill_tokens += plan.num_prefill_tokens
