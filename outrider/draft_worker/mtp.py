"""`mtp`: DeepSeek-V3's multi-token-prediction module drafts from the checkpoint itself.

    {"method": "mtp", "model": "/path/to/DeepSeek-V3", "num_speculative_tokens": 1}

The module (arXiv 2412.19437 section 2.2; docs/algorithms.md section 6) sits in the checkpoint
under `model.layers.{L}.*`, L = num_hidden_layers, and turns the target's hidden state h_i
(the state that predicted t_{i+1}) and the embedding of t_{i+1} into a prediction of t_{i+2}:

    x = eh_proj(cat(enorm(embed(t_{i+1})), hnorm(h_i)))      embedding first, as released
    x = block(x)                                             the architecture's own decoder layer
    logits = shared_head.head(shared_head.norm(x))

The block is whatever decoder layer the checkpoint's architecture has (MLA + MoE for
DeepSeek-V3, a Llama layer for the demo target's MTP head, `_MTP_BLOCKS`), run on the
target runner's own layer code with a one-layer KV cache of its own. `embed_tokens` and
`shared_head.head` are read from the MTP layer when present (the release duplicates them
there, and the demo head ships them so the draft worker needs no target weights), else from
the main model's `model.embed_tokens` / `lm_head`.

Features: the target sends, per new token t_p, its final hidden state after the final norm
at the position before (`FeatureSpec.layer_ids = (L,)`, the engine's convention; a zero row
at position 0). MTP row p = (t_p, h_{p-1}) at RoPE position p and cache row start + p, so
committed rows are exact and a round only prefills the delta:

    prefill   rows of the new tokens (accepted + recovered/bonus = the root), one forward for
              the batch; the root's row gives draft 1 and its normalised output y_root
    chain     draft k+1 from row (d_k, y of the previous row) at position root + k: the
              module reused autoregressively, its own output standing in for the target's
              not-yet-computed hidden state (the target has not run the root yet)
    tree      with top_k > 1, EAGLE-2 trees through `tree_builder.build_trees`, one forward
              per depth for the batch (`model_drafting.HiddenHandoffScratch`): node j is the row
              (its token, y of its parent's row) at position root + depth, in scratch row
              start + L + j, attending to the context and its own ancestors; its q row is
              the builder's, drawn from exactly as sent, so sampled verification is lossless

Draft rows sit past the committed ones and are overwritten next round (rollback by
position).

No speculation cache (`can_fork` False), and not for want of a fork: a fork could borrow the
extent as draft_model's does. What it cannot have is the next update's features. A
speculated round r + 1 extends the state by the delta (accepted path + bonus token), and
`propose` would prefill the delta's rows with the target's final hidden states at the root
and the accepted nodes, which the target computes while verifying round r. The module's own
y is not those states (it is the stand-in the chain uses for drafts, not what the target
sends), so a tree drafted from it would not be the tree `propose` builds, and adopting that
fork would leave rows in the cache that the real features never wrote. Speculating only the
part that needs no features does not help either: draft 1 of round r + 1 already needs the
feature of its root's predecessor.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from outrider.draft_worker.model_drafting import (
    NO_DRAFT,
    ChainStep,
    HiddenHandoffScratch,
    check_model_options,
    draft_chains,
    draft_vocabulary,
)
from outrider.draft_worker.path_processors import DraftProcessors
from outrider.draft_worker.proposer import Proposer, register_proposer, root_only_tree
from outrider.draft_worker.tree_builder import build_trees, draft_generator
from outrider.proto import CandidateTree, FeatureSpec, SequenceUpdate, TreeBudget
from outrider.target_worker.batch import ForwardBatch, SequenceChunk, build_forward_batch
from outrider.target_worker.kv_cache import CacheFullError, KVCache, KVSpec
from outrider.target_worker.layers.attention import AttentionPlan, plan_attention
from outrider.target_worker.layers.fp8 import maybe_fp8
from outrider.target_worker.layers.linear import Linear
from outrider.target_worker.layers.norm import RMSNorm
from outrider.target_worker.layers.rope import RotaryEmbedding
from outrider.target_worker.loader import DTYPES, CheckpointError, CheckpointReader
from outrider.target_worker.models import resolve_architecture
from outrider.target_worker.models.deepseek_v3 import DeepseekV3Block, DeepseekV3Config, DeepseekV3Model
from outrider.target_worker.models.llama import LlamaBlock, LlamaFamilyConfig, LlamaFamilyModel
from outrider.target_worker.parallel.group import TPGroup

# (block, rope, per-token cache buffers) of the MTP layer, by the checkpoint's architecture.
BlockParts = tuple[Callable, RotaryEmbedding, tuple[tuple[str, tuple[int, ...]], ...]]


def _llama_block(reader, layer: int, dtype, device, max_positions: int) -> BlockParts:
    cfg = LlamaFamilyConfig.from_hf(reader.config)
    block = LlamaBlock(reader, layer, cfg, TPGroup(), dtype, device)
    shape = (block.num_kv_heads, block.head_dim)
    return block, RotaryEmbedding(cfg.head_dim, cfg.rope, max_positions, device), (("k", shape), ("v", shape))


def _deepseek_block(reader, layer: int, dtype, device, max_positions: int) -> BlockParts:
    cfg = DeepseekV3Config.from_hf(reader.config)
    block = DeepseekV3Block(reader, layer, cfg, TPGroup(), dtype, device)
    rope = RotaryEmbedding(cfg.qk_rope_head_dim, cfg.rope, max_positions, device)
    return block, rope, (("c_kv", (cfg.kv_lora_rank,)), ("k_pe", (cfg.qk_rope_head_dim,)))


_MTP_BLOCKS: dict[type, Callable[..., BlockParts]] = {
    LlamaFamilyModel: _llama_block,
    DeepseekV3Model: _deepseek_block,
}


class MTPModule:
    """The MTP layer of a checkpoint, for inference (no TP: drafters run on one device)."""

    def __init__(self, path: str | Path, dtype: torch.dtype | None, device, max_positions: int):
        raw = CheckpointReader(path)
        reader = maybe_fp8(raw)
        cfg = raw.config
        self.dtype = dtype or raw.checkpoint_dtype
        self.layer = layer = int(cfg["num_hidden_layers"])
        self.hidden_size, self.vocab_size = int(cfg["hidden_size"]), int(cfg["vocab_size"])
        p = f"model.layers.{layer}."
        if not raw.has(p + "eh_proj.weight"):
            raise CheckpointError(f"{path}: no MTP module (model.layers.{layer}.eh_proj.weight is missing)")
        arch = resolve_architecture(cfg)
        if arch not in _MTP_BLOCKS:
            raise CheckpointError(f"{path}: MTP drafting is not implemented for {arch.__name__}")
        self.block, self.rope, self.buffers = _MTP_BLOCKS[arch](
            reader, layer, self.dtype, device, max_positions
        )
        eps = float(cfg.get("rms_norm_eps", 1e-6))

        def read(name: str, fallback: str | None = None) -> torch.Tensor:
            name = p + name if raw.has(p + name) or fallback is None else fallback
            return reader.read(name, self.dtype).to(device)

        self.embed = read("embed_tokens.weight", "model.embed_tokens.weight")  # [V, H]
        head_fallback = "model.embed_tokens.weight" if cfg.get("tie_word_embeddings") else "lm_head.weight"
        self.head = Linear(read("shared_head.head.weight", head_fallback))
        self.enorm, self.hnorm = RMSNorm(read("enorm.weight"), eps), RMSNorm(read("hnorm.weight"), eps)
        self.eh_proj = Linear(read("eh_proj.weight"))  # [H, 2H]: embedding columns first
        self.head_norm = RMSNorm(read("shared_head.norm.weight"), eps)

    def forward(
        self,
        batch: ForwardBatch,  # tokens t_p at positions p, cache rows, masks; logits_rows = rows to score
        hidden: torch.Tensor,  # [T, H] h_{p-1} for each token (the target's, or the module's own y)
        plan: AttentionPlan,
        kv: tuple[torch.Tensor, ...],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits [R, V], y [R, H] = shared_head.norm(block output)) at `batch.logits_rows`."""
        x = torch.cat([self.enorm(self.embed[batch.input_ids]), self.hnorm(hidden.to(self.dtype))], dim=1)
        x = self.block(self.eh_proj(x), self.rope.lookup(batch.positions), batch.cache_rows, plan, kv)
        y = self.head_norm(x if batch.logits_rows is None else x[batch.logits_rows])
        return self.head(y), y


@dataclass(frozen=True)
class MTPOptions:
    model: str | None = None  # checkpoint folder holding model.layers.{num_hidden_layers}.*
    max_model_len: int | None = None  # default: its max_position_embeddings
    kv_cache_rows: int | None = None  # default: max_sequences full-length sequences
    dtype: str | None = None  # "float32" | "bfloat16" | "float16"; default: the checkpoint's
    target_vocab_fingerprint: str | None = None  # as for draft_model: checked against tokenizer.json

    def __post_init__(self) -> None:
        check_model_options("mtp", self.model, self.dtype, "the checkpoint with the MTP layer")


@dataclass
class MTPState:
    seq_id: int
    generator: torch.Generator | None
    tokens: list[int] = field(default_factory=list)  # committed tokens; the last is the next root
    features: list[torch.Tensor] = field(default_factory=list)  # [n, H] rows for tokens[cached:]
    start: int | None = None  # first row of the KV extent; None = not admitted
    cached: int = 0  # tokens[:cached] have their MTP row in the extent
    broken: bool = False  # features missing or misaligned: no drafts until a reset


@register_proposer("mtp")
class MTPProposer(Proposer[MTPState]):
    Options = MTPOptions
    default_num_speculative_tokens = 1  # DeepSeek-V3 ships one MTP module
    can_fork = False  # the delta's features exist only after the target verifies it (docstring)

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        options: MTPOptions = self.config.options
        size, fingerprint = draft_vocabulary(options.model)
        expected = options.target_vocab_fingerprint
        if size != self.vocab_size or (expected and fingerprint and expected != fingerprint):
            raise ValueError(
                f"mtp: {options.model} has a different vocabulary from the target "
                f"({size} tokens vs {self.vocab_size}, or another tokenizer)"
            )
        hf_config = json.loads((Path(options.model) / "config.json").read_text())
        self.max_model_len = options.max_model_len or int(hf_config.get("max_position_embeddings", 2048))
        budget = self.config.budget
        # Scratch rows: a chain's drafts, or every expanded node of a tree (as draft_model's).
        self.scratch_rows = max(1, (budget.max_depth - 1) * budget.top_k)
        self.extent_rows = self.max_model_len + self.scratch_rows
        dtype = DTYPES[options.dtype] if options.dtype else None
        self.module = MTPModule(options.model, dtype, self.device, self.extent_rows)
        spec = KVSpec(num_layers=1, buffers=self.module.buffers, dtype=self.module.dtype)
        self.cache = KVCache(
            spec, options.kv_cache_rows or self.max_sequences * self.extent_rows, self.device
        )
        self.forwards = 0

    @property
    def feature_spec(self) -> FeatureSpec:
        dtype = str(self.module.dtype).removeprefix("torch.")
        return FeatureSpec(layer_ids=(self.module.layer,), hidden_size=self.module.hidden_size, dtype=dtype)

    def new_state(self, update: SequenceUpdate) -> MTPState:
        old = self._states.get(update.seq_id)
        if old is not None:  # a reset replaces the state without `finished`
            self.retire(old)
        return MTPState(update.seq_id, draft_generator(update.sampling.seed))

    def extend(self, state: MTPState, update: SequenceUpdate) -> None:
        features = update.features
        if features is None or features.shape != (update.new_tokens.numel(), self.module.hidden_size):
            state.broken = True
        else:
            state.features.append(features.to(self.device))
        state.tokens.extend(update.new_tokens.tolist())

    def fork_state(self, state: MTPState) -> None:
        """No speculation cache: the next round's features are the target's (module docstring)."""
        return None

    def retire(self, state: MTPState) -> None:
        if state.start is not None:
            self.cache.free(state.seq_id)
            state.start = None

    def draft(self, updates: Sequence[SequenceUpdate], states: Sequence[MTPState]) -> list[CandidateTree]:
        budgets = [NO_DRAFT] * len(updates)
        drafting = [b for b, s in enumerate(states) if self._admit(s)]
        for b in drafting:
            budget = self.budget(updates[b])
            depth = min(budget.max_depth, self.max_model_len - len(states[b].tokens))
            if depth > 0 and budget.max_nodes > 1 and budget.top_k > 0:
                budgets[b] = replace(budget, max_depth=depth)
        drafting = [b for b in drafting if budgets[b] is not NO_DRAFT]
        if not drafting:
            return [root_only_tree(u) for u in updates]
        logits, hidden = self._prefill([states[b] for b in drafting])
        if all(budgets[b].top_k == 1 and updates[b].sampling.greedy for b in drafting):
            return self._draft_chains(updates, states, budgets, logits, hidden)
        root_logits = torch.zeros(len(updates), logits.shape[1], dtype=logits.dtype, device=logits.device)
        root_y = torch.zeros(len(updates), hidden.shape[1], dtype=hidden.dtype, device=hidden.device)
        root_logits[drafting], root_y[drafting] = logits, hidden
        scratch = HiddenHandoffScratch(self._run, self.device, self.scratch_rows, states, root_y)
        trees = build_trees(
            updates,
            budgets,
            root_logits,
            scratch,
            sampled_mode=self.config.sampled_mode,
            generators=[s.generator for s in states],
            processors=DraftProcessors.of(updates, states),
        )
        self.forwards += scratch.forwards
        return trees

    def _admit(self, state: MTPState) -> bool:
        if state.broken or len(state.tokens) > self.max_model_len:
            self.retire(state)
            return False
        if state.start is None:
            try:
                state.start = self.cache.allocate(state.seq_id, self.extent_rows)
            except CacheFullError:
                return False
            if state.cached:  # evicted earlier: its rows are gone and their features dropped
                state.broken = True
                self.retire(state)
                return False
        return True

    def _forward(self, batch: ForwardBatch, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.forwards += 1
        return self._run(batch, hidden)

    def _run(self, batch: ForwardBatch, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits, y) of the batch's rows; `hidden` [T, H] = each row's h_{p-1} or parent y."""
        self.cache.check_rows(batch)
        with torch.inference_mode():
            return self.module.forward(batch, hidden, plan_attention(batch), self.cache.layers[0])

    def _prefill(self, states: Sequence[MTPState]) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward over every sequence's uncached rows; the roots' (logits, y)."""
        chunks = [
            SequenceChunk(s.start, s.cached, torch.tensor(s.tokens[s.cached :], dtype=torch.int64))
            for s in states
        ]
        hidden = torch.cat([torch.cat(s.features) for s in states])
        out = self._forward(build_forward_batch(chunks, device=self.device), hidden)
        for s in states:
            s.cached, s.features = len(s.tokens), []
        return out

    def _draft_chains(
        self,
        updates: Sequence[SequenceUpdate],
        states: Sequence[MTPState],
        budgets: Sequence[TreeBudget],
        logits: torch.Tensor,  # [drafting rows, V] from each root's row
        hidden: torch.Tensor,  # [drafting rows, H] y of each root's row
    ) -> list[CandidateTree]:
        """`draft_chains` over the module, reused autoregressively: each step's row takes the
        previous row's y in place of the target's hidden state (module docstring)."""
        carried = hidden  # [rows still drafting, H] their newest y

        def step(chain: ChainStep) -> torch.Tensor:
            nonlocal carried
            batch = build_forward_batch(chain.decode_chunks(states), device=self.device)
            next_logits, carried = self._forward(batch, carried[chain.keep])
            return next_logits

        # Every drafting row has a chain (depth and nodes left, top_k 1): `first` gets exactly them.
        return draft_chains(
            updates,
            budgets,
            lambda active: logits,
            step,
            sampled_mode=self.config.sampled_mode,
            processors=DraftProcessors.of(updates, states),
        )
