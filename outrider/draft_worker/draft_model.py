"""`draft_model`: an independent small LM drafts chains or EAGLE-2 trees (vLLM's `draft_model`).

    {"method": "draft_model", "model": "/path/to/draft", "num_speculative_tokens": 4}       a chain
    {"method": "draft_model", "model": ..., "num_speculative_tokens": 5, "tree_top_k": 4,
     "tree_max_nodes": 16}                                                                    a tree

The draft is any Llama-family checkpoint with the target's vocabulary (the demo family's
`draft/`), run on the target runner's own model code (`ModelRunner`) with its own KV cache.
Per sequence the state is the committed tokens, a KV extent and how many of the tokens are in
it; a round, for the whole batch at once:

    prefill   one forward over every sequence's uncached tokens (the round's delta, ending in
              the root): the root's logits, and the delta's K/V at its absolute positions
    expand    one forward per tree depth through `tree_builder.build_trees`, over the
              frontier rows of every sequence together (`model_drafting.TreeScratch`); when
              every budget is a chain (top_k = 1), the same trees without the builder
              (`model_drafting.draft_chains`)

The draft extent of a sequence (context rows by absolute position, then this round's scratch
rows, nothing rolled back) is drawn in `model_drafting`.

A sequence that does not fit (KV cache full, or past the draft's `max_model_len`) gets
root-only trees, so the target decodes it without speculation: drafting costs speed, never
a request. It is admitted again later if the cache frees up.

Forks (the speculation cache, `draft_worker.speculation`) borrow the sequence's extent and
keep no rows of their own. While they draft, each gets a scratch extent whose first L rows
are a copy of the committed ones, so all of a sequence's forks draft in one batch; the
scratch extents are freed as soon as the trees are out:

    sequence extent   | committed context ... root | (the real state's tree nodes, stale) |
    scratch, fork i   | copy of the L rows         | fork i's delta | its tree nodes |   freed

A fork then points at the borrowed extent with `cached` = L, so if it is adopted (`adopt`
hands the extent over) its delta is prefilled once more next round: a hit's next prefill is
a delta longer, and no fork ever holds a row. When the cache has no room for the scratch
extents, the forks draft one at a time in the borrowed extent itself, past the committed
rows, where the real state keeps nothing (its next prefill starts at start + L and
overwrites them); two forks at once would write the same rows there. A fork never frees the
extent it borrows (`DraftModelState.lender`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from outrider.draft_worker.model_drafting import (
    NO_DRAFT,
    ChainStep,
    TreeScratch,
    check_model_options,
    draft_chains,
    draft_vocabulary,
)
from outrider.draft_worker.path_processors import DraftProcessors
from outrider.draft_worker.proposer import NO_HINTS, DraftHints, Proposer, register_proposer
from outrider.draft_worker.tree_builder import build_trees, draft_generator
from outrider.proto import CandidateTree, SequenceUpdate
from outrider.target_worker.batch import SequenceChunk, build_forward_batch
from outrider.target_worker.kv_cache import CacheFullError
from outrider.target_worker.loader import DTYPES
from outrider.target_worker.runner import ModelRunner


@dataclass(frozen=True)
class DraftModelOptions:
    model: str | None = None  # draft checkpoint folder (HF layout, safetensors)
    max_model_len: int | None = None  # draft context; default: its max_position_embeddings
    kv_cache_rows: int | None = None  # draft KV budget in rows; default: max_sequences full-length ones
    kv_cache_bytes: int | None = None  # ... or in bytes
    dtype: str | None = None  # "float32" | "bfloat16" | "float16"; default: the checkpoint's
    # The target tokenizer's `proto.handshake.vocab_fingerprint`; when set, the draft's own
    # tokenizer.json must match it (same size is not enough: ids could mean other tokens).
    target_vocab_fingerprint: str | None = None

    def __post_init__(self) -> None:
        check_model_options("draft_model", self.model, self.dtype, "the draft checkpoint folder")
        if self.kv_cache_rows is not None and self.kv_cache_bytes is not None:
            raise ValueError("draft_model: give kv_cache_rows or kv_cache_bytes, not both")


@dataclass
class DraftModelState:
    seq_id: int
    generator: torch.Generator | None
    tokens: list[int] = field(default_factory=list)  # committed tokens; the last is the next root
    start: int | None = None  # first row of the KV extent; None = not admitted
    cached: int = 0  # tokens[:cached] have their K/V in the extent
    # A fork: the real state whose extent it borrows (never frees); None: the extent is its own.
    lender: DraftModelState | None = field(default=None, repr=False, compare=False)


@register_proposer("draft_model")
class DraftModelProposer(Proposer[DraftModelState]):
    Options = DraftModelOptions
    retire_shares_state = False  # retiring frees only the sequence's own extent

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        options: DraftModelOptions = self.config.options
        size, self.vocab_fingerprint = draft_vocabulary(options.model)
        self._check_vocabulary(options, size)
        hf_config = json.loads((Path(options.model) / "config.json").read_text())
        self.max_model_len = options.max_model_len or int(hf_config.get("max_position_embeddings", 2048))
        budget = self.config.budget
        # Scratch rows: every expanded node of a round (the deepest level is never expanded),
        # and for chains one more, the last draft's step that gives the q after it (outcome rows).
        self.scratch_rows = max(1, (budget.max_depth - 1) * budget.top_k + (budget.top_k == 1))
        self.extent_rows = self.max_model_len + self.scratch_rows
        rows = options.kv_cache_rows
        if rows is None and options.kv_cache_bytes is None:
            rows = self.max_sequences * self.extent_rows
        self.runner = ModelRunner.from_pretrained(
            options.model,
            max_model_len=self.extent_rows,  # kv_lens count scratch rows too
            kv_cache_rows=rows,
            kv_cache_bytes=options.kv_cache_bytes,
            dtype=DTYPES[options.dtype] if options.dtype else None,
            device=self.device,
        )
        self.forwards = 0  # draft forward passes so far (one prefill + one per expanded depth per round)

    def _check_vocabulary(self, options: DraftModelOptions, size: int) -> None:
        expected = options.target_vocab_fingerprint
        if size != self.vocab_size or (
            expected and self.vocab_fingerprint and expected != self.vocab_fingerprint
        ):
            theirs = f", tokenizer fingerprint {expected[:16]}…" if expected else ""
            ours = f", tokenizer fingerprint {self.vocab_fingerprint[:16]}…" if self.vocab_fingerprint else ""
            raise ValueError(
                f"draft_model: the draft {options.model} has a different vocabulary from the target "
                f"(draft: {size} tokens{ours}; target: {self.vocab_size} tokens{theirs}); "
                "a draft model must share the target's tokenizer"
            )
        if expected and self.vocab_fingerprint is None:
            raise ValueError(
                f"draft_model: target_vocab_fingerprint was given but {options.model} has no "
                "tokenizer.json to check it against"
            )

    def new_state(self, update: SequenceUpdate) -> DraftModelState:
        old = self._states.get(update.seq_id)
        if old is not None:  # a reset: the old state is replaced without `finished`
            self.retire(old)
        return DraftModelState(update.seq_id, draft_generator(update.sampling.seed))

    def extend(self, state: DraftModelState, update: SequenceUpdate) -> None:
        # Only bookkeeping: the K/V of the new tokens is computed in `draft`, batched.
        state.tokens.extend(update.new_tokens.tolist())

    # ---- speculation: forks borrow the extent (module docstring) ------------------------------

    def fork_state(self, state: DraftModelState) -> DraftModelState | None:
        """A fork over the state's committed rows; None when the state holds no extent."""
        if state.start is None or state.lender is not None:
            return None
        return DraftModelState(
            state.seq_id,
            _clone(state.generator),
            list(state.tokens),
            start=state.start,
            cached=state.cached,
            lender=state,
        )

    def speculate(
        self, seq_id: int, updates: Sequence[SequenceUpdate], hints: DraftHints = NO_HINTS
    ) -> list[tuple[CandidateTree, DraftModelState]] | None:
        """As `Proposer.speculate`: every fork in one batch, each in a scratch extent holding a
        copy of the context rows; without room for those, one fork at a time in the sequence's
        own extent. Either way each fork ends as the module docstring says (borrowed, rewound)."""
        made = self._extended_forks(seq_id, updates)
        if made is None:
            return None
        base, forks = made
        scratch = self._scratch_extents(base, forks)
        try:
            hints.check_interrupted()
            if scratch is not None:
                for fork, start in zip(forks, scratch, strict=True):
                    fork.start = fork.start if start is None else start
                trees = self.draft_with_hints(updates, forks, hints)
            else:  # forks of one sequence write the same rows of its extent: one at a time
                trees = [
                    self.draft_with_hints([u], [f], hints)[0] for u, f in zip(updates, forks, strict=True)
                ]
        finally:
            for i, start in enumerate(scratch or []):
                if start is not None:
                    self.runner.cache.free(("fork", i))
            for fork in forks:  # back in the borrowed extent, its rows past L given up
                fork.start, fork.cached = base.start, min(fork.cached, base.cached)
        return list(zip(trees, forks, strict=True))

    def _scratch_extents(
        self, base: DraftModelState, forks: list[DraftModelState]
    ) -> list[int | None] | None:
        """A scratch extent per fork (None for one past max_model_len, which drafts nothing),
        its first L rows a copy of the base's; None when the cache has no room for them all."""
        cache, starts = self.runner.cache, []
        try:
            for i, fork in enumerate(forks):
                fits = len(fork.tokens) <= self.max_model_len
                starts.append(
                    cache.allocate(("fork", i), len(fork.tokens) + self.scratch_rows) if fits else None
                )
        except CacheFullError:
            for i, start in enumerate(starts):
                if start is not None:
                    cache.free(("fork", i))
            return None
        length = base.cached
        for start in starts:
            if start is not None:
                for buffer in cache.buffers.values():  # [layers, rows, ...]
                    buffer[:, start : start + length].copy_(buffer[:, base.start : base.start + length])
        return starts

    def adopt(self, seq_id: int, state: DraftModelState) -> None:
        """The fork takes over the extent it borrowed, and the replaced state's rows are freed."""
        old = self._states.get(seq_id)
        if state.lender is not None:
            if state.lender is old and old.start == state.start:
                old.start = None  # the extent changes hands: nothing to free, nothing to copy
            else:  # its lender is gone (cannot happen via spec_cache): prefill it anew
                state.start, state.cached = None, 0
            state.lender = None
        if old is not None and old is not state:
            self.retire(old)
        super().adopt(seq_id, state)

    def release_state(self, state: DraftModelState) -> None:
        """A discarded fork holds no rows; it only becomes inert (it never drafts again)."""
        if state.lender is not None:
            state.start = None

    def retire(self, state: DraftModelState) -> None:
        if state.start is not None and state.lender is None:
            self.runner.cache.free(state.seq_id)
        state.start = None

    def draft(
        self, updates: Sequence[SequenceUpdate], states: Sequence[DraftModelState]
    ) -> list[CandidateTree]:
        return self.draft_with_hints(updates, states, NO_HINTS)

    def draft_with_hints(
        self, updates: Sequence[SequenceUpdate], states: Sequence[DraftModelState], hints: DraftHints
    ) -> list[CandidateTree]:
        """As `draft`; chains honour both hints (outcome rows, an interrupt between steps)."""
        drafting = [b for b, s in enumerate(states) if self._admit(s)]
        vocab = self.vocab_size
        root_logits = torch.zeros(len(updates), vocab, device=self.runner.device)  # [batch, vocab]
        budgets = [NO_DRAFT] * len(updates)
        if drafting:
            root_logits[drafting] = self._prefill([states[b] for b in drafting]).to(root_logits.dtype)
            for b in drafting:
                budget = self.budget(updates[b])
                room = self.max_model_len - states[b].cached  # positions left after the root
                depth = min(budget.max_depth, room)
                budgets[b] = replace(budget, max_depth=depth) if depth > 0 else NO_DRAFT
        processors = DraftProcessors.of(updates, states)
        if all(b.top_k <= 1 for b in budgets) and all(u.sampling.greedy for u in updates):

            def step(chain: ChainStep) -> torch.Tensor:
                self.forwards += 1
                batch = build_forward_batch(chain.decode_chunks(states), device=self.runner.device)
                return self.runner.forward(batch).logits

            return draft_chains(
                updates,
                budgets,
                lambda active: root_logits[active],
                step,
                sampled_mode=self.config.sampled_mode,
                hints=hints,
                processors=processors,
            )
        scratch = TreeScratch(
            lambda batch: self.runner.forward(batch).logits, self.runner.device, self.scratch_rows, states
        )
        trees = build_trees(
            updates,
            budgets,
            root_logits,
            scratch,
            sampled_mode=self.config.sampled_mode,
            generators=[s.generator for s in states],
            processors=processors,
        )
        self.forwards += scratch.forwards
        return trees

    def _admit(self, state: DraftModelState) -> bool:
        """Whether the sequence drafts this round: it fits the draft's context and has an extent."""
        if len(state.tokens) > self.max_model_len:
            if state.lender is None:  # a fork leaves the extent to its lender
                self.retire(state)
            return False
        if state.start is None:
            if state.lender is not None:  # a released fork
                return False
            try:
                state.start = self.runner.cache.allocate(state.seq_id, self.extent_rows)
            except CacheFullError:
                return False
            state.cached = 0
        return True

    def _prefill(self, states: Sequence[DraftModelState]) -> torch.Tensor:
        """One forward over every sequence's uncached tokens; [len(states), vocab] root logits."""
        chunks = [
            SequenceChunk(s.start, s.cached, torch.tensor(s.tokens[s.cached :], dtype=torch.int64))
            for s in states
        ]
        out = self.runner.forward(build_forward_batch(chunks, device=self.runner.device))
        self.forwards += 1
        for s in states:
            s.cached = len(s.tokens)
        return out.logits


def _clone(generator: torch.Generator | None) -> torch.Generator | None:
    """An independent generator in the same state: a fork draws what the state would have."""
    if generator is None:
        return None
    copy = torch.Generator(generator.device)
    copy.set_state(generator.get_state())
    return copy
