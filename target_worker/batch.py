"""What one ragged forward pass is asked to do, and what it returns.

    sequence:     A (prefill, 4)    B (decode)   C (tree, 5 nodes)
    input_ids:    a0 a1 a2 a3 |     b0 |         r c1 c2 c3 c4
    cu_seqlens:   0             4      5                      10
    positions:    0  1  2  3  |     17 |         9 10 10 11 11      (context + depth)
    cache_rows:   A+0 .. A+3  |     B+17 |       C+9 .. C+13        (extent start + context + i)

A tree's nodes are written to consecutive cache rows after its context (node i at
context + i) although siblings share a RoPE position; after verification the accepted
path is compacted (`KVCache.commit_path`) and rejected rows are simply overwritten later.

`build_forward_batch` turns per-sequence `SequenceChunk`s into a `ForwardBatch`, using
`kernels` for tree positions and masks; the runner itself never sees trees, only masks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from outrider.kernels.tree_buffers import build_tree_buffers, tree_attention_mask


@dataclass(frozen=True)
class HiddenCapture:
    """Hidden states to return alongside logits, for every token of the batch."""

    layer_inputs: tuple[int, ...] = ()  # layers whose *input* residual stream is returned
    final: bool = False  # the last layer's output after the final norm

    @staticmethod
    def eagle3(num_layers: int) -> HiddenCapture:
        """EAGLE-3 fuses the inputs of layers {2, L//2, L-3} (docs/algorithms.md section 3)."""
        return HiddenCapture(layer_inputs=(2, num_layers // 2, num_layers - 3), final=True)


@dataclass(frozen=True)
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64; each sequence's new tokens, back to back
    positions: torch.Tensor  # [T] int64; RoPE position (context_len + depth for tree nodes)
    cache_rows: torch.Tensor  # [T] int64; absolute KV-cache row each token's K/V goes to
    cu_seqlens: tuple[int, ...]  # [B + 1]; sequence b owns tokens cu_seqlens[b]:cu_seqlens[b+1]
    kv_starts: tuple[int, ...]  # [B]; first cache row of sequence b's extent
    kv_lens: tuple[int, ...]  # [B]; rows b attends to from kv_starts[b]: context + new tokens
    attn_masks: tuple[torch.Tensor | None, ...]  # [B]; [n_b, kv_lens[b]] bool or None = causal
    logits_rows: torch.Tensor | None = None  # [R] int64; rows of [T] to return logits for; None = all
    capture: HiddenCapture = field(default_factory=HiddenCapture)

    @property
    def num_tokens(self) -> int:
        return self.cu_seqlens[-1]

    @property
    def batch_size(self) -> int:
        return len(self.kv_starts)


@dataclass
class ForwardOutput:
    logits: torch.Tensor  # [R, V]; rows in `ForwardBatch.logits_rows` order
    final_hidden: torch.Tensor | None = None  # [T, H]; after the final norm, if captured
    layer_inputs: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [T, H]


@dataclass(frozen=True)
class SequenceChunk:
    """One sequence's share of a forward: a prompt chunk, one decode token, or a tree."""

    cache_start: int  # first row of the sequence's cache extent (`KVCache.allocate`)
    context_len: int  # tokens whose K/V is already in the cache
    token_ids: torch.Tensor  # [n] int64; for a tree, node 0 is the root
    parents: torch.Tensor | None = None  # [n] int64 local parents, -1 at the root; None = chain
    all_logits: bool = False  # chains: logits of every token, not only the last (trees: always)
    # Logits of the first `prompt_logits` tokens too, returned after every chunk's own rows, so
    # the rows verification reads keep their places (prompt logprobs).
    prompt_logits: int = 0


def build_forward_batch(
    chunks: list[SequenceChunk],
    capture: HiddenCapture | None = None,
    device: torch.device | str = "cpu",
) -> ForwardBatch:
    sizes = [int(c.token_ids.numel()) for c in chunks]
    cu = [0]
    for n in sizes:
        cu.append(cu[-1] + n)
    positions, masks, logits_rows = [], [], []
    trees = [b for b, c in enumerate(chunks) if c.parents is not None]
    tree_positions, tree_masks = _tree_inputs([chunks[b] for b in trees], device)
    tree_of = {b: i for i, b in enumerate(trees)}
    for b, (chunk, n) in enumerate(zip(chunks, sizes, strict=True)):
        ctx = chunk.context_len
        if b in tree_of:
            positions.append(tree_positions[tree_of[b]])
            masks.append(tree_masks[tree_of[b]])
        else:
            positions.append(torch.arange(ctx, ctx + n, device=device))
            masks.append(None)
        all_rows = chunk.all_logits or b in tree_of
        logits_rows.append(torch.arange(cu[b] if all_rows else cu[b + 1] - 1, cu[b + 1]))
    logits_rows += [
        torch.arange(cu[b], cu[b] + c.prompt_logits) for b, c in enumerate(chunks) if c.prompt_logits
    ]
    rows = [
        torch.arange(c.cache_start + c.context_len, c.cache_start + c.context_len + n)
        for c, n in zip(chunks, sizes, strict=True)
    ]
    return ForwardBatch(
        input_ids=torch.cat([c.token_ids for c in chunks]).to(device=device, dtype=torch.int64),
        positions=torch.cat(positions).to(device),
        cache_rows=torch.cat(rows).to(device),
        cu_seqlens=tuple(cu),
        kv_starts=tuple(c.cache_start for c in chunks),
        kv_lens=tuple(c.context_len + n for c, n in zip(chunks, sizes, strict=True)),
        attn_masks=tuple(masks),
        logits_rows=torch.cat(logits_rows).to(device),
        capture=capture or HiddenCapture(),
    )


def _tree_inputs(
    trees: list[SequenceChunk], device: torch.device | str
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per tree: positions [n] and attention mask [n, context_len + n], via `kernels`."""
    if not trees:
        return [], []
    sizes = [int(t.token_ids.numel()) for t in trees]
    cu = torch.tensor([0, *sizes], dtype=torch.int64, device=device).cumsum(0)
    context_lens = torch.tensor([t.context_len for t in trees], dtype=torch.int64, device=device)
    parents = torch.cat([t.parents for t in trees]).to(device=device, dtype=torch.int64)
    buffers = build_tree_buffers(parents, cu, context_lens)
    num_kv = max(t.context_len + n for t, n in zip(trees, sizes, strict=True))
    full = tree_attention_mask(buffers.tree_mask, cu, context_lens, num_kv)  # [B, 1, N, num_kv]
    starts = cu.tolist()
    positions = [buffers.positions[starts[i] : starts[i + 1]] for i in range(len(trees))]
    masks = [full[i, 0, :n, : t.context_len + n] for i, (t, n) in enumerate(zip(trees, sizes, strict=True))]
    return positions, masks
