"""What one ragged forward pass is asked to do, and what it returns.

    sequence:     A (prefill, 4)    B (decode)   C (tree, 5 nodes)
    input_ids:    a0 a1 a2 a3 |     b0 |         r c1 c2 c3 c4
    cu_seqlens:   0             4      5                      10
    positions:    0  1  2  3  |     17 |         9 10 10 11 11      (context + depth)
    slots:        0  1  2  3  |     17 |         9 10 11 12 13      (context + i)
    cache_rows:   row(A, 0..3)|  row(B, 17) |    row(C, 9..13)

Every token has a *slot* (its index in the sequence's cache rows: context + i, so a tree's
node i sits at slot context + i although siblings share a RoPE position) and a cache row:
`row(s, slot)` is `start + slot` for a contiguous extent (`SequenceChunk.cache_start`, the
drafters' caches) or `blocks[slot // block_size] * block_size + slot % block_size` for a paged
sequence (`SequenceChunk.blocks`, the target's `BlockManager`). Attention reads a sequence's
slots 0 .. kv_len - 1 through `block_tables` (paged) or `kv_index` (extents: the row of each
slot). After
verification the accepted path is compacted (`kernels.compact_kv` over the tree's slots) and
rejected rows are simply overwritten later.

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
    kv_index: (
        torch.Tensor | None
    )  # extents: [B, max kv_len] int64 row of each slot (padded validly); paged: None
    kv_lens: tuple[int, ...]  # [B]; slots b attends to: context + new tokens
    attn_masks: tuple[torch.Tensor | None, ...]  # [B]; [n_b, kv_lens[b]] bool or None = causal
    logits_rows: torch.Tensor | None = None  # [R] int64; rows of [T] to return logits for; None = all
    capture: HiddenCapture = field(default_factory=HiddenCapture)
    block_tables: torch.Tensor | None = None  # paged: [B, max blocks] int64, padded with each's first
    block_size: int = 0  # paged: slots per block (attention gathers whole blocks, not rows)

    @property
    def num_tokens(self) -> int:
        return self.cu_seqlens[-1]

    @property
    def batch_size(self) -> int:
        return len(self.kv_lens)


@dataclass
class ForwardOutput:
    logits: torch.Tensor  # [R, V]; rows in `ForwardBatch.logits_rows` order
    final_hidden: torch.Tensor | None = None  # [T, H]; after the final norm, if captured
    layer_inputs: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [T, H]


@dataclass(frozen=True)
class SequenceChunk:
    """One sequence's share of a forward: a prompt chunk, one decode token, or a tree."""

    cache_start: int  # first row of the sequence's cache extent (`KVCache.allocate`); -1 if paged
    context_len: int  # tokens whose K/V is already in the cache
    token_ids: torch.Tensor  # [n] int64; for a tree, node 0 is the root
    parents: torch.Tensor | None = None  # [n] int64 local parents, -1 at the root; None = chain
    all_logits: bool = False  # chains: logits of every token, not only the last (trees: always)
    blocks: list[int] | None = None  # paged: the block table, covering slots 0 .. context_len + n - 1
    block_size: int = 0
    # Logits of the first `prompt_logits` tokens too, returned after every chunk's own rows, so
    # the rows verification reads keep their places (prompt logprobs).
    prompt_logits: int = 0


def build_forward_batch(
    chunks: list[SequenceChunk],
    capture: HiddenCapture | None = None,
    device: torch.device | str = "cpu",
) -> ForwardBatch:
    # Built from Python lists with one tensor per field: a round's batch is rebuilt every step,
    # and a handful of small torch ops per sequence would cost more than the indexing itself.
    sizes = [int(c.token_ids.numel()) for c in chunks]
    cu = [0]
    for n in sizes:
        cu.append(cu[-1] + n)
    trees = [b for b, c in enumerate(chunks) if c.parents is not None]
    tree_positions, tree_masks = _tree_inputs([chunks[b] for b in trees], device)
    tree_of = {b: i for i, b in enumerate(trees)}
    paged = _paged(chunks)
    positions, rows, logits_rows, masks = [], [], [], []
    for b, (chunk, n) in enumerate(zip(chunks, sizes, strict=True)):
        ctx = chunk.context_len
        if b in tree_of:
            positions.extend(tree_positions[tree_of[b]].tolist())
            masks.append(tree_masks[tree_of[b]])
        else:
            positions.extend(range(ctx, ctx + n))
            masks.append(None)
        if paged:  # slot -> row through the block table
            table, size = chunk.blocks, chunk.block_size
            rows.extend(table[slot // size] * size + slot % size for slot in range(ctx, ctx + n))
        else:
            rows.extend(range(chunk.cache_start + ctx, chunk.cache_start + ctx + n))
        all_rows = chunk.all_logits or b in tree_of
        logits_rows.extend(range(cu[b] if all_rows else cu[b + 1] - 1, cu[b + 1]))
    for b, chunk in enumerate(chunks):  # prompt logprobs: after every chunk's own rows
        logits_rows.extend(range(cu[b], cu[b] + chunk.prompt_logits))
    kv_lens = [c.context_len + n for c, n in zip(chunks, sizes, strict=True)]
    tables = _block_tables(chunks, kv_lens) if paged else None
    return ForwardBatch(
        input_ids=torch.cat([c.token_ids for c in chunks]).to(device=device, dtype=torch.int64),
        positions=torch.tensor(positions, dtype=torch.int64, device=device),
        cache_rows=torch.tensor(rows, dtype=torch.int64, device=device),
        cu_seqlens=tuple(cu),
        kv_index=None
        if paged
        else extent_index(torch.tensor([c.cache_start for c in chunks]), kv_lens).to(device),
        kv_lens=tuple(kv_lens),
        block_tables=tables.to(device) if tables is not None else None,
        block_size=chunks[0].block_size if paged else 0,
        attn_masks=tuple(masks),
        # Every row, in order (a decode or verify round): None, so the model skips a gather.
        logits_rows=None
        if len(logits_rows) == cu[-1] and logits_rows == list(range(cu[-1]))
        else torch.tensor(logits_rows, dtype=torch.int64, device=device),
        capture=capture or HiddenCapture(),
    )


def _paged(chunks: list[SequenceChunk]) -> bool:
    kinds = {c.blocks is not None for c in chunks}
    if len(kinds) > 1:
        raise ValueError("one forward batch cannot mix paged sequences and contiguous extents")
    return kinds == {True}


def _block_tables(chunks: list[SequenceChunk], kv_lens: list[int]) -> torch.Tensor:
    """[B, max blocks] int64: each chunk's block table, padded with its first block."""
    size = chunks[0].block_size
    width = max(len(c.blocks) for c in chunks)
    for chunk, kv_len in zip(chunks, kv_lens, strict=True):
        if chunk.block_size != size or len(chunk.blocks) * size < kv_len:
            raise ValueError(
                f"a paged chunk needs blocks of {size} slots covering its {kv_len} slots; "
                f"it has {len(chunk.blocks)} of {chunk.block_size}"
            )
    return torch.tensor(
        [c.blocks + c.blocks[:1] * (width - len(c.blocks)) for c in chunks], dtype=torch.int64
    )


def extent_index(starts: torch.Tensor, kv_lens: list[int]) -> torch.Tensor:
    """[B, max kv_len] `kv_index` of contiguous extents: start_b + slot, start_b past kv_len."""
    slot = torch.arange(max(kv_lens), device=starts.device)[None, :]
    lens = torch.tensor(kv_lens, device=starts.device)[:, None]
    return starts.to(torch.int64)[:, None] + torch.where(slot < lens, slot, 0)


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
