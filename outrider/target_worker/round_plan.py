"""What each running sequence contributes to a round's one forward, and where its results are.

Every sequence that reaches its root this round is *verified*: a decoding one with its tree
(root-only when it has no draft: one decode token), or one whose final prompt chunk ends at
its root (a chain whose last logits row is the root's). Prompt chunks that stop short of the
root only fill the cache. Verified sequences come first, so their logits rows are the first
rows the forward returns:

    chunks:       A tree (4 nodes) | B decode | C last prompt chunk | D prompt chunk (partial)
    logits rows:  a0 a1 a2 a3      | b0       | c_last              | d_last (unused)
    verify nodes: a0 a1 a2 a3        b0         c_last                = PackedTrees node order

A prefill token budget per round bounds how much prompt work joins the decodes, so a long
prompt is chunked over several rounds instead of stalling every running sequence.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from outrider.kernels import PackedTrees, pack_trees
from outrider.proto import CandidateTree, DraftSampling, check_trees
from outrider.target_worker.batch import ForwardBatch, HiddenCapture, SequenceChunk, build_forward_batch
from outrider.target_worker.sequence import Sequence

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RoundPlan:
    forward: ForwardBatch
    verified: list[Sequence]  # [B] sequences verified this round, in tree order
    trees: PackedTrees | None  # [B] their trees (None if B = 0); logits rows 0 .. total_nodes - 1, node order
    # [B, max tree size] int64: cache row of each tree node's slot (`compact_kv`); None when every
    # tree is root-only (nothing to compact: plain decoding builds none)
    slot_map: torch.Tensor | None
    filled: list[Sequence]  # sequences whose prompt chunk stops short of the root (chunks after the B)
    num_prefill_tokens: int  # prompt tokens in this forward (final and partial chunks)
    # Sequences asking for prompt logprobs, with how many of their prompt tokens this forward
    # predicts; their logits rows follow every chunk's own, from row `prompt_logits_start`.
    prompt_logits: list[tuple[Sequence, int]]
    prompt_logits_start: int


# Shared by every root-only tree (one per sequence per round without a draft): read, never written.
_ROOT_PARENTS = torch.tensor([-1], dtype=torch.int64)
_NO_Q_NODES = torch.empty(0, dtype=torch.int64)
_NO_Q_IDS = torch.empty(0, 0, dtype=torch.int64)
_NO_Q_PROBS = torch.empty(0, 0, dtype=torch.float32)


def root_only_tree(seq: Sequence, round: int) -> CandidateTree:
    """No draft tokens: verifying it is plain decoding of one token."""
    return CandidateTree(
        seq_id=seq.seq_id,
        round=round,
        tokens=torch.tensor(seq.tokens[-1:], dtype=torch.int64),
        parents=_ROOT_PARENTS,
        q_nodes=_NO_Q_NODES,
        q_token_ids=_NO_Q_IDS,
        q_probs=_NO_Q_PROBS,
        sampling=DraftSampling.DETERMINISTIC,
    )


def checked_trees(
    ready: list[Sequence], received: dict[int, CandidateTree], validated: bool, vocab_size: int, round: int
) -> tuple[list[CandidateTree], int, int, int]:
    """The tree each of `ready` verifies this round: the drafter's if it is sound (for the round
    and root the sequence is at, within its budget, unless `validated` on arrival), else
    root-only. Returns the trees and how many were used, dropped as invalid, and missing."""
    answered = [(s, received[s.seq_id]) for s in ready if s.seq_id in received]
    pairs = [(s, t) for s, t in answered if len(t.tokens) > 1]  # a root alone drafts nothing: no checks
    num_asked = sum(s.asked for s in ready)
    for seq in ready:
        seq.asked = False  # answered (or not) this round
    if validated or not pairs:
        errors = [None] * len(pairs)
    else:
        errors = check_trees([t for _, t in pairs], [s.budget for s, _ in pairs], vocab_size)
    good = {}
    for (seq, tree), error in zip(pairs, errors, strict=True):
        if error is None and tree.round != seq.tree_round:
            error = f"tree for round {tree.round}, expected round {seq.tree_round}"
        elif error is None and int(tree.tokens[0]) != seq.tokens[-1]:
            error = f"root token {int(tree.tokens[0])} is not the last committed token {seq.tokens[-1]}"
        if error is None:
            good[seq.seq_id] = tree
        else:
            log.debug("dropped the tree of sequence %d: %s", seq.seq_id, error)
    trees = [good[s.seq_id] if s.seq_id in good else root_only_tree(s, round) for s in ready]
    empty = len(answered) - len(pairs)
    return trees, len(good) + empty, len(pairs) - len(good), num_asked - len(answered)


def tree_depth(tree: CandidateTree) -> int:
    """Draft tokens on the tree's longest root-to-leaf path (0 for a root-only tree)."""
    parents = tree.parents.tolist()
    depth = [0] * len(parents)
    for i in range(1, len(parents)):
        depth[i] = depth[parents[i]] + 1
    return max(depth)


def plan_round(
    decoding: list[tuple[Sequence, CandidateTree]],  # decoding sequences and this round's trees
    prefilling: list[Sequence],  # the others (no output token yet), in admission order
    max_prefill_tokens: int,
    round: int,
    capture: HiddenCapture | None,
    device: torch.device,
    block_size: int,
) -> RoundPlan:
    verified, trees, chunks = [], [], []
    for seq, tree in decoding:
        # A chain (node i under node i - 1; one node is a decode) needs no tree mask: plain
        # causal attention over its rows gives the same result without building one.
        chain = tree.num_nodes == 1 or bool(torch.equal(tree.parents, torch.arange(-1, tree.num_nodes - 1)))
        parents = None if chain else tree.parents
        chunks.append(
            SequenceChunk(
                -1,
                seq.num_cached,
                tree.tokens,
                parents,
                all_logits=True,
                blocks=seq.blocks,
                block_size=block_size,
            )
        )
        verified.append(seq)
        trees.append(tree)
    partial, partial_chunks, budget, prompt_logits = [], [], max_prefill_tokens, []
    for seq in prefilling:
        take = min(budget, len(seq.tokens) - seq.num_cached)
        if take <= 0:
            break
        budget -= take
        ids = torch.tensor(seq.tokens[seq.num_cached : seq.num_cached + take], dtype=torch.int64)
        # Rows predicting prompt tokens: every token of the chunk but the prompt's last (the root's row).
        wants = seq.params.prompt_logprobs is not None and not seq.decoding  # a recompute has sent them
        predicted = min(take, seq.num_prompt - 1 - seq.num_cached) if wants else 0
        if predicted:
            prompt_logits.append((seq, predicted))
        chunk = SequenceChunk(
            -1, seq.num_cached, ids, blocks=seq.blocks, block_size=block_size, prompt_logits=predicted
        )
        if seq.num_cached + take == len(seq.tokens):  # reaches the root: its last row is a decode
            chunks.append(chunk)
            verified.append(seq)
            trees.append(root_only_tree(seq, round))
        else:
            partial.append(seq)
            partial_chunks.append(chunk)
    forward = build_forward_batch(chunks + partial_chunks, capture=capture, device=device)
    return RoundPlan(
        forward=forward,
        verified=verified,
        trees=pack_trees(trees, device=device) if trees else None,
        slot_map=_tree_slot_map(forward, [t.num_nodes for t in trees]),
        filled=partial,
        num_prefill_tokens=max_prefill_tokens - budget,
        prompt_logits=prompt_logits,
        prompt_logits_start=sum(int(t.tokens.numel()) for t in trees) + len(partial),
    )


def _tree_slot_map(forward: ForwardBatch, tree_sizes: list[int]) -> torch.Tensor | None:
    """[B, max tree size]: the cache row of node i of verified sequence b's tree (a tree is
    its chunk's last rows; past its size, its last node's row). None if no tree has a draft."""
    if max(tree_sizes, default=1) == 1:
        return None
    sizes = torch.tensor(tree_sizes)
    ends = torch.tensor(forward.cu_seqlens[1 : len(tree_sizes) + 1])
    node = torch.minimum(torch.arange(int(sizes.max()))[None, :], sizes[:, None] - 1)
    return forward.cache_rows[(ends - sizes)[:, None] + node]
