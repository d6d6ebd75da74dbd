"""What the model-based proposers share (draft_model, eagle3, peagle, mtp): the empty budget,
checkpoint option checks, chains drafted without the tree builder, and scratch KV rows for
the tree builder's per-depth forwards.

Each sequence owns a KV extent laid out by absolute position, as in the target's cache:

    | committed context ... root | scratch: this round's tree nodes, in expansion order |
    ^ start                       ^ start + L (L = cached tokens, root included)

Tree node j of the round is written to row start + L + j at RoPE position L - 1 + depth and
attends to the context and its own ancestors (an explicit mask; a chain step is a plain
decode). Nothing is rolled back: next round's delta (accepted tokens + the recovered or
bonus token) is prefilled at start + L, overwriting whatever drafted rows sit there.

    chain_tree     a chain's CandidateTree from its drafts and q rows
    draft_chains   top_k = 1 trees for a batch, one forward per depth, without the builder
    TreeScratch    the builder's `LogitsFn`: a depth's frontier into the scratch rows, one forward
    HiddenHandoffScratch   ... for drafters whose rows also take their parent's output hidden
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from outrider.draft_worker.path_processors import DraftProcessors
from outrider.draft_worker.proposer import NO_HINTS, DraftHints, root_only_tree
from outrider.draft_worker.tree_builder import Frontier
from outrider.proto import CandidateTree, DraftSampling, SequenceUpdate, TreeBudget
from outrider.proto.handshake import vocab_fingerprint
from outrider.target_worker.batch import ForwardBatch, SequenceChunk, extent_index
from outrider.target_worker.loader import DTYPES

NO_DRAFT = TreeBudget(max_nodes=1, max_depth=0, top_k=0)


class ExtentState(Protocol):
    """A sequence's KV extent, as every model-based proposer's state holds it."""

    start: int | None  # first row of the KV extent; None = not admitted
    cached: int  # tokens with their K/V in the extent (L)


def check_model_options(method: str, model: str | None, dtype: str | None, what: str) -> None:
    """The checks every model-based method's Options share: a checkpoint folder, a known dtype."""
    if not model:
        raise ValueError(f"{method}: the key 'model' ({what}) is required")
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"{method}: dtype {dtype!r}; use one of {sorted(DTYPES)}")


def draft_vocabulary(path: str | Path) -> tuple[int, str | None]:
    """(embedding rows from config.json, vocab fingerprint of tokenizer.json or None if absent)."""
    path = Path(path)
    size = int(json.loads((path / "config.json").read_text())["vocab_size"])
    tokenizer_file = path / "tokenizer.json"
    if not tokenizer_file.is_file():
        return size, None
    from tokenizers import Tokenizer

    return size, vocab_fingerprint(Tokenizer.from_file(str(tokenizer_file)).get_vocab(with_added_tokens=True))


def chain_tree(
    update: SequenceUpdate,
    drafts: list[int],
    probs: list[float] | None,
    sampling: DraftSampling,
    *,
    rows: list[list[tuple[int, float]]] | None = None,
) -> CandidateTree:
    """A chain rooted at the update's last token; node i + 1 was drawn from q row i.

    By default row i is the one entry (drafts[i], probs[i]). `rows` replaces them: row i is
    (token, q) pairs led by drafts[i], and a row past the last draft (`len(drafts) + 1` rows)
    is the q after the leaf, which only the speculation cache reads. Rows are padded to the
    widest with (-1, 0.0).
    """
    if rows is None:
        rows = [[(d, q)] for d, q in zip(drafts, probs, strict=True)]
    width = max(len(row) for row in rows)
    padded = [row + [(-1, 0.0)] * (width - len(row)) for row in rows]
    return CandidateTree(
        seq_id=update.seq_id,
        round=update.round,
        tokens=torch.tensor([int(update.new_tokens[-1]), *drafts], dtype=torch.int64),
        parents=torch.arange(-1, len(drafts), dtype=torch.int64),
        q_nodes=torch.arange(len(rows), dtype=torch.int64),
        q_token_ids=torch.tensor([[t for t, _ in row] for row in padded], dtype=torch.int64),  # [rows, width]
        q_probs=torch.tensor([[q for _, q in row] for row in padded], dtype=torch.float32),  # [rows, width]
        sampling=sampling,
    )


@dataclass(frozen=True)
class ChainStep:
    """One step of `draft_chains`: the chains that need another draft after `depth` drafts."""

    depth: int  # drafts so far on each of these chains; the next is draft depth + 1
    rows: list[int]  # their batch rows
    keep: list[int]  # their places among the previous step's rows (to carry per-row tensors)
    last: list[int]  # each one's newest draft

    def decode_chunks(self, states: Sequence[ExtentState]) -> list[SequenceChunk]:
        """Each newest draft at position L + depth (the root at L - 1): a plain decode step."""
        return [
            SequenceChunk(states[b].start, states[b].cached + self.depth, torch.tensor([t]))
            for b, t in zip(self.rows, self.last, strict=True)
        ]


def draft_chains(
    updates: Sequence[SequenceUpdate],
    budgets: Sequence[TreeBudget],
    first_logits: Callable[[list[int]], torch.Tensor],  # batch rows -> [rows, V] the roots' logits
    step: Callable[[ChainStep], torch.Tensor],  # -> [len(step.rows), V] logits of their next draft
    *,
    sampled_mode: DraftSampling,
    hints: DraftHints = NO_HINTS,
    token_ids: torch.Tensor | None = None,  # [V] the token of each logit (a reduced draft vocabulary)
    processors: DraftProcessors | None = None,  # the target's path processors (full-vocabulary logits)
) -> list[CandidateTree]:
    """Chains without the tree builder's ranking (its per-depth sorts cost more than a small
    draft's forward), giving exactly its top_k = 1 trees: each child is the argmax; its q row
    is the softmax's top probability when greedy, else a point mass (1.0), which the verifier
    accepts with p(x). A budget with top_k != 1 gets a root-only tree."""
    lengths = [min(b.max_depth, b.max_nodes - 1) if b.top_k == 1 else 0 for b in budgets]
    # Outcome rows (the speculation cache asks for them): each q row also names the
    # runner-up, and one more step gives the q after the last draft, so the cache can
    # rank (accepted length, bonus) outcomes without drafting probes.
    width, extra = (2, 1) if hints.outcome_rows else (1, 0)
    drafts: list[list[int]] = [[] for _ in updates]
    rows: list[list[list[tuple[int, float]]]] = [[] for _ in updates]
    active = [b for b, n in enumerate(lengths) if n > 0]
    logits = first_logits(active)  # [len(active), V]
    for depth in range(max(lengths, default=0) + extra):
        hints.check_interrupted()  # only while speculating
        if processors is not None:  # each chain's drafts so far are its path
            paths = torch.tensor([drafts[b][:depth] for b in active], dtype=torch.int64).view(
                len(active), depth
            )
            logits = processors(logits, torch.tensor(active), paths)
        top_q, top_t = logits.float().softmax(-1).topk(width, dim=-1)  # [len(active), width] each
        if token_ids is not None:
            top_t = token_ids[top_t]
        for b, tokens, qs in zip(active, top_t.tolist(), top_q.tolist(), strict=True):
            if depth < lengths[b]:
                drafts[b].append(tokens[0])
            if updates[b].sampling.greedy:  # as wide as the budget lets q rows be
                rows[b].append(list(zip(tokens, qs, strict=True))[: max(1, budgets[b].q_width)])
            else:  # a point mass, which the verifier accepts with p(x)
                rows[b].append([(tokens[0], 1.0)])
        keep = [i for i, b in enumerate(active) if lengths[b] + extra > depth + 1]  # the last needs no logits
        if not keep:
            break
        active = [active[i] for i in keep]
        logits = step(ChainStep(depth, active, keep, [drafts[b][-1] for b in active]))
    return [
        chain_tree(u, d, None, DraftSampling.DETERMINISTIC if u.sampling.greedy else sampled_mode, rows=r)
        if d
        else root_only_tree(u)
        for u, d, r in zip(updates, drafts, rows, strict=True)
    ]


class TreeScratch:
    """The `LogitsFn` of one round: writes each depth's frontier into the sequences' scratch
    rows and returns its logits, one `forward` for the whole batch; counts them in `forwards`.
    `forward` None: a subclass overrides `forward_grouped` (`HiddenHandoffScratch`)."""

    def __init__(
        self,
        forward: Callable[[ForwardBatch], torch.Tensor] | None,  # -> [rows, vocab] logits
        device: torch.device,
        scratch_rows: int,
        states: Sequence[ExtentState],
    ):
        self.forward, self.device = forward, device
        self.forwards = 0
        self.start = torch.tensor([s.start or 0 for s in states], dtype=torch.int64)  # [batch]
        self.cached = torch.tensor([s.cached for s in states], dtype=torch.int64)  # [batch] L
        self.used = torch.zeros(len(states), dtype=torch.int64)  # [batch] scratch rows written
        # [rows of the last call, scratch_rows] bool: which scratch rows each row attends to.
        self.ancestors = torch.zeros(0, scratch_rows, dtype=torch.bool, device=device)

    def __call__(self, frontier: Frontier) -> torch.Tensor:  # [frontier.num_rows, vocab]
        device = self.device
        seq = frontier.seq_index.cpu()  # [R]
        # Rows grouped by sequence (they normally already are): one ragged chunk each.
        order = seq.argsort(stable=True)
        seq = seq[order]
        counts = torch.bincount(seq, minlength=self.used.shape[0])  # [batch]
        first = counts.cumsum(0) - counts
        slot = self.used[seq] + torch.arange(seq.shape[0]) - first[seq]  # [R] scratch row of each
        self.used += counts
        parent = frontier.parent_row.to(device)[order.to(device)]
        if frontier.depth == 1:
            ancestors = torch.zeros(seq.shape[0], self.ancestors.shape[1], dtype=torch.bool, device=device)
        else:
            ancestors = self.ancestors[parent]
        ancestors[torch.arange(seq.shape[0], device=device), slot.to(device)] = True
        self.ancestors = torch.empty_like(ancestors)
        self.ancestors[order.to(device)] = ancestors  # kept in the builder's row order

        present = counts.nonzero().squeeze(1)
        kv_lens, masks = [], []
        for b, n, f in zip(present.tolist(), counts[present].tolist(), first[present].tolist(), strict=True):
            length, used = int(self.cached[b]), int(self.used[b])
            kv_lens.append(length + used)
            visible = ancestors[f : f + n, :used]
            if n == 1 and bool(visible.all()):
                masks.append(None)  # a chain step: the newest row attends to everything, a decode
            else:
                context = torch.ones(n, length, dtype=torch.bool, device=device)
                masks.append(torch.cat([context, visible], 1))
        cu = torch.cat([torch.zeros(1, dtype=torch.int64), counts[present].cumsum(0)])
        batch = ForwardBatch(
            input_ids=frontier.tokens.to(device)[order.to(device)],
            positions=(self.cached[seq] - 1 + frontier.depth).to(device),
            cache_rows=(self.start[seq] + self.cached[seq] + slot).to(device),
            cu_seqlens=tuple(cu.tolist()),
            kv_index=extent_index(self.start[present], kv_lens).to(device),
            kv_lens=tuple(kv_lens),
            attn_masks=tuple(masks),
        )
        logits = self.forward_grouped(batch, frontier, order.to(device))  # [R, vocab] in grouped order
        self.forwards += 1
        out = torch.empty_like(logits)
        out[order.to(device)] = logits
        return out

    def forward_grouped(self, batch: ForwardBatch, frontier: Frontier, order: torch.Tensor) -> torch.Tensor:
        """[R, vocab] logits of `batch`, whose rows are the frontier's in `order` (grouped by sequence)."""
        return self.forward(batch)


class HiddenHandoffScratch(TreeScratch):
    """`TreeScratch` (scratch rows, ancestor masks) for drafters whose rows also take an input
    hidden: each row's is its parent's output (the root's for depth 1), as EAGLE's head takes
    its parent's hidden and MTP its parent row's y."""

    def __init__(
        self,
        forward: Callable[[ForwardBatch, torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
        device: torch.device,
        scratch_rows: int,
        states: Sequence[ExtentState],
        root_hidden: torch.Tensor,  # [batch, H] the roots' output hidden
    ):
        super().__init__(None, device, scratch_rows, states)
        self.forward_hidden = forward  # (batch, [rows, H] input hidden) -> (logits, [rows, H] output)
        self.parent_hidden = root_hidden  # [batch, H] at depth 1, then [rows of the previous call, H]

    def forward_grouped(self, batch: ForwardBatch, frontier: Frontier, order: torch.Tensor) -> torch.Tensor:
        device = self.parent_hidden.device
        index = frontier.seq_index if frontier.depth == 1 else frontier.parent_row
        logits, hidden_out = self.forward_hidden(
            batch, self.parent_hidden[index.to(device)][order.to(device)]
        )
        self.parent_hidden = torch.empty_like(hidden_out)
        self.parent_hidden[order.to(device)] = hidden_out  # kept in the builder's row order
        return logits
