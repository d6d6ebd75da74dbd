"""`eagle3`: an EAGLE-3 head drafts EAGLE-2 dynamic trees from the target's fused features.

    {"method": "eagle3", "model": "/path/to/head", "num_speculative_tokens": 6,
     "tree_top_k": 4, "tree_max_nodes": 24}
    {"method": "eagle3", "model": "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B (converted to safetensors)",
     "target_model": "/path/to/Llama-3.1-8B-Instruct", "num_speculative_tokens": 5}

The head (`draft_worker.eagle_head`) is read from a published-layout folder; its embedding
from the head (`embed_tokens.weight`) or, as published heads omit it, from `target_model`.
Features: the inputs of target layers {2, L//2, L-3} (`eagle3_layer_ids`; the head's
config.json may name them under eagle_config), concatenated. Row j of an update's features
is the target state *before* new_tokens[j] (the engine's convention), so the drafter's row
for token t_k is (t_k, g_{k-1}) with g = fc(features). With `project_features_on_target`
the target applies fc itself (`feature_projection`) and only H values per token cross the
wire; `extend` then takes the rows as g.

Per sequence the state is the committed tokens, their g rows, and a KV extent laid out as in
`draft_model` (context rows at their absolute positions, then this round's scratch). A round,
for the whole batch at once:

    prefill   one forward over every sequence's uncached rows (ending in the root): the root's
              draft logits and output hidden
    expand    one forward per depth (`tree_builder.build_trees`, or `model_drafting.draft_chains`
              when every budget is a chain); a child row is (its token, its parent's output hidden)

Draft logits cover the head's reduced vocabulary (`d2t`: target id = draft id + d2t[id]);
trees get full-vocabulary logits with -inf outside it, so q is exactly what was drafted from.
A sequence that does not fit (KV cache full, past max_model_len) gets root-only trees.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from outrider.draft_worker.eagle_head import EagleHead, eagle3_layer_ids, load_head, rope_table
from outrider.draft_worker.model_drafting import (
    NO_DRAFT,
    ChainStep,
    HiddenHandoffScratch,
    check_model_options,
    draft_chains,
)
from outrider.draft_worker.path_processors import DraftProcessors
from outrider.draft_worker.proposer import Proposer, register_proposer, root_only_tree
from outrider.draft_worker.tree_builder import build_trees, draft_generator
from outrider.proto import CandidateTree, FeatureSpec, SequenceUpdate, TreeBudget
from outrider.target_worker.batch import ForwardBatch, SequenceChunk, build_forward_batch
from outrider.target_worker.kv_cache import CacheFullError, KVCache, KVSpec
from outrider.target_worker.loader import DTYPES


@dataclass(frozen=True)
class Eagle3Options:
    model: str | None = None  # head folder: config.json + model.safetensors (published layout)
    target_model: str | None = None  # target folder: embed_tokens when the head has none; its L
    target_num_layers: int | None = None  # L, when neither the head config nor target_model gives the layers
    project_features_on_target: bool = False  # the target applies fc; H values per token on the wire
    feature_dtype: str = "float32"  # features on the wire: float32 | bfloat16 | float16
    max_model_len: int | None = None  # default: the head's max_position_embeddings
    kv_cache_rows: int | None = None  # default: max_sequences full-length sequences
    dtype: str | None = None  # default: the checkpoint's

    def __post_init__(self) -> None:
        check_model_options("eagle3/peagle", self.model, self.dtype, "the head checkpoint folder")


@dataclass
class EagleState:
    seq_id: int
    generator: torch.Generator | None
    tokens: list[int] = field(default_factory=list)  # committed; the last is the next root
    g: torch.Tensor | None = None  # [len(tokens), H] the row input of each token (fc of its features)
    start: int | None = None  # first row of the KV extent; None = not admitted
    cached: int = 0  # tokens[:cached] have their K/V in the extent


@register_proposer("eagle3")
class Eagle3Proposer(Proposer[EagleState]):
    Options = Eagle3Options
    can_fork = False  # the state owns a KV extent (see draft_model)

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        options: Eagle3Options = self.config.options
        self.head: EagleHead = load_head(options.model, embed_from=options.target_model, device=self.device)
        if options.dtype:
            self.head.to(DTYPES[options.dtype])
        cfg = self.head.cfg
        if cfg.vocab_size != self.vocab_size:
            raise ValueError(
                f"{self.method}: the head {options.model} has a vocabulary of {cfg.vocab_size}; "
                f"the target has {self.vocab_size}"
            )
        self.layer_ids = self._layer_ids(options)
        self.max_model_len = options.max_model_len or cfg.max_position_embeddings
        budget = self.config.budget
        self.scratch_rows = max(1, (budget.max_depth - 1) * budget.top_k, self._extra_rows())
        self.extent_rows = self.max_model_len + self.scratch_rows
        self.head.rope = rope_table(cfg.head_dim, cfg.rope_theta, self.extent_rows + 1).to(self.device)
        spec = KVSpec(
            num_layers=cfg.num_layers,
            buffers=(("k", (cfg.num_kv_heads, cfg.head_dim)), ("v", (cfg.num_kv_heads, cfg.head_dim))),
            dtype=self.head.fc.weight.dtype,
        )
        self.cache = KVCache(
            spec, options.kv_cache_rows or self.max_sequences * self.extent_rows, self.device
        )
        self.draft_ids = self.head.draft_ids  # [Vd] target id of each draft id
        self.forwards = 0  # draft forward passes so far

    def _extra_rows(self) -> int:
        return 0

    def _layer_ids(self, options: Eagle3Options) -> tuple[int, ...]:
        if self.head.cfg.feature_layer_ids is not None:
            return tuple(self.head.cfg.feature_layer_ids)
        num_layers = options.target_num_layers
        if num_layers is None and options.target_model:
            num_layers = json.loads((Path(options.target_model) / "config.json").read_text())[
                "num_hidden_layers"
            ]
        if num_layers is None:
            raise ValueError(
                f"{self.method}: {options.model} does not name its target layers; give `target_model` "
                "or `target_num_layers` so the standard EAGLE-3 layers {2, L//2, L-3} can be used"
            )
        return eagle3_layer_ids(int(num_layers))

    @property
    def feature_spec(self) -> FeatureSpec:
        cfg = self.head.cfg
        return FeatureSpec(
            layer_ids=self.layer_ids,
            hidden_size=cfg.target_hidden_size or cfg.hidden_size,
            projected=self.config.options.project_features_on_target,
            dtype=self.config.options.feature_dtype,
        )

    def feature_projection(self) -> torch.Tensor:
        """fc [H, 3H]: what the target applies under `project_features_on_target`."""
        return self.head.fc.weight.detach().float().cpu()

    # ---- state ------------------------------------------------------------------------------

    def new_state(self, update: SequenceUpdate) -> EagleState:
        old = self._states.get(update.seq_id)
        if old is not None:
            self.retire(old)
        return EagleState(update.seq_id, draft_generator(update.sampling.seed))

    @torch.inference_mode()
    def extend(self, state: EagleState, update: SequenceUpdate) -> None:
        n = int(update.new_tokens.shape[0])
        features = update.features
        dtype = self.head.fc.weight.dtype
        if features is None:  # nothing to condition on (should not happen with a feature spec)
            g = torch.zeros(n, self.head.cfg.hidden_size, dtype=dtype, device=self.device)
        elif self.config.options.project_features_on_target:
            g = features.to(self.device, dtype)
        else:
            g = self.head.project(features.to(self.device, dtype))
        state.tokens.extend(update.new_tokens.tolist())
        state.g = g if state.g is None else torch.cat([state.g, g])

    def fork_state(self, state: EagleState) -> None:
        return None

    def retire(self, state: EagleState) -> None:
        if state.start is not None:
            self.cache.free(state.seq_id)
            state.start = None

    def _admit(self, state: EagleState) -> bool:
        if len(state.tokens) > self.max_model_len:
            self.retire(state)
            return False
        if state.start is None:
            try:
                state.start = self.cache.allocate(state.seq_id, self.extent_rows)
            except CacheFullError:
                return False
            state.cached = 0
        return True

    # ---- the network ------------------------------------------------------------------------

    def head_forward(self, batch: ForwardBatch, hidden: torch.Tensor) -> torch.Tensor:
        """[T, H] output hidden of the batch's rows; their K/V written to the cache."""
        self.cache.check_rows(batch)
        self.forwards += 1
        return self.head(batch, hidden, self.cache.layers)

    def _tree_forward(self, batch: ForwardBatch, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(full-vocabulary logits, output hidden) of tree rows taking `hidden` [rows, H] in."""
        out = self.head_forward(batch, hidden)
        return self.full_logits(out), out

    @torch.inference_mode()
    def full_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[R, H] output hidden -> [R, vocab] logits, -inf outside the draft vocabulary."""
        logits = self.head.logits(hidden).float()
        full = logits.new_full((logits.shape[0], self.vocab_size), float("-inf"))
        full[:, self.draft_ids] = logits
        return full

    def _prefill_rows(self, states: Sequence[EagleState]) -> tuple[ForwardBatch, torch.Tensor]:
        chunks = [
            SequenceChunk(s.start, s.cached, torch.tensor(s.tokens[s.cached :], dtype=torch.int64))
            for s in states
        ]
        hidden = torch.cat([s.g[s.cached :] for s in states])
        return build_forward_batch(chunks, device=self.device), hidden

    @torch.inference_mode()
    def _prefill(self, states: Sequence[EagleState]) -> torch.Tensor:
        """One forward over every sequence's uncached rows; [len(states), H] root output hidden."""
        batch, hidden = self._prefill_rows(states)
        out = self.head_forward(batch, hidden)
        for s in states:
            s.cached = len(s.tokens)
        return out if batch.logits_rows is None else out[batch.logits_rows]

    # ---- drafting ---------------------------------------------------------------------------

    def _budgets(self, updates, states, drafting) -> list[TreeBudget]:
        budgets = [NO_DRAFT] * len(updates)
        for b in drafting:
            budget = self.budget(updates[b])
            depth = min(budget.max_depth, self.max_model_len - states[b].cached)
            budgets[b] = replace(budget, max_depth=depth) if depth > 0 else NO_DRAFT
        return budgets

    @torch.inference_mode()
    def draft(self, updates: Sequence[SequenceUpdate], states: Sequence[EagleState]) -> list[CandidateTree]:
        drafting = [b for b, s in enumerate(states) if self._admit(s)]
        if not drafting:
            return [root_only_tree(u) for u in updates]
        hidden = torch.zeros(len(updates), self.head.cfg.hidden_size, device=self.device)
        hidden[drafting] = self._prefill([states[b] for b in drafting]).to(hidden.dtype)
        hidden = hidden.to(self.head.fc.weight.dtype)
        budgets = self._budgets(updates, states, drafting)
        if all(b.top_k <= 1 for b in budgets) and all(u.sampling.greedy for u in updates):
            return self._draft_chains(updates, states, budgets, hidden)
        scratch = HiddenHandoffScratch(self._tree_forward, self.device, self.scratch_rows, states, hidden)
        return build_trees(  # head_forward counts the forwards
            updates,
            budgets,
            self.full_logits(hidden),
            scratch,
            sampled_mode=self.config.sampled_mode,
            generators=[s.generator for s in states],
            processors=DraftProcessors.of(updates, states),
        )

    def _draft_chains(
        self,
        updates: Sequence[SequenceUpdate],
        states: Sequence[EagleState],
        budgets: Sequence[TreeBudget],
        hidden: torch.Tensor,  # [batch, H] the roots' output hidden
    ) -> list[CandidateTree]:
        """`draft_chains` over the head: each step's row takes its parent's output hidden, and
        logits over the reduced vocabulary map to target ids (`draft_ids`)."""
        carried = hidden  # [rows still drafting, H] their newest output hidden
        processors = DraftProcessors.of(updates, states)
        # The processors index the target's vocabulary: then logits over it (-inf off the draft's).
        logits_of = self.head.logits if processors is None else self.full_logits

        def first(active: list[int]) -> torch.Tensor:
            nonlocal carried
            carried = hidden[active]
            return logits_of(carried)

        def step(chain: ChainStep) -> torch.Tensor:
            nonlocal carried
            batch = build_forward_batch(chain.decode_chunks(states), device=self.device)
            carried = self.head_forward(batch, carried[chain.keep])
            return logits_of(carried)

        return draft_chains(
            updates,
            budgets,
            first,
            step,
            sampled_mode=self.config.sampled_mode,
            token_ids=self.draft_ids if processors is None else None,
            processors=processors,
        )
