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
sequence (`SequenceChunk.blocks`, the target's `BlockManager`). `kv_index` lists, per
sequence, the rows of slots 0 .. kv_len - 1, which is all attention needs. After
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
    kv_index: torch.Tensor  # [B, max kv_len] int64; cache row of each slot b attends to (padded validly)
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
    kv_lens = [c.context_len + n for c, n in zip(chunks, sizes, strict=True)]
    kv_index, tables = slot_rows(chunks, kv_lens)  # [B, max kv_len], [B, max blocks] or None
    # Token i of sequence b sits at slot context_b + i: its row is kv_index[b, context_b + i].
    owner = torch.repeat_interleave(torch.arange(len(chunks)), torch.tensor(sizes))  # [T]
    first_slot = torch.tensor([c.context_len - cu[b] for b, c in enumerate(chunks)])  # [B]
    slots = torch.arange(cu[-1]) + first_slot[owner]  # [T]
    return ForwardBatch(
        input_ids=torch.cat([c.token_ids for c in chunks]).to(device=device, dtype=torch.int64),
        positions=torch.cat(positions).to(device),
        cache_rows=kv_index[owner, slots].to(device),
        cu_seqlens=tuple(cu),
        kv_index=kv_index.to(device),
        kv_lens=tuple(kv_lens),
        block_tables=tables.to(device) if tables is not None else None,
        block_size=chunks[0].block_size if tables is not None else 0,
        attn_masks=tuple(masks),
        logits_rows=torch.cat(logits_rows).to(device),
        capture=capture or HiddenCapture(),
    )


def slot_rows(chunks: list[SequenceChunk], kv_lens: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[B, max kv_len] int64: the cache row of each sequence's slots (past kv_len, the row of
    its slot 0: a valid row that attention masks out); and the padded block tables, if paged."""
    if all(c.blocks is None for c in chunks):  # contiguous extents
        return extent_index(torch.tensor([c.cache_start for c in chunks]), kv_lens), None
    width = max(kv_lens)
    slot = torch.arange(width)[None, :].expand(len(chunks), width)  # [B, W]
    slot = torch.where(slot < torch.tensor(kv_lens)[:, None], slot, 0)
    block_size = next(c.block_size for c in chunks if c.blocks is not None)
    num_blocks = max(len(c.blocks) if c.blocks is not None else 0 for c in chunks)
    tables = torch.tensor(
        [_table_of(c, n, block_size, num_blocks) for c, n in zip(chunks, kv_lens, strict=True)]
    )
    return tables.gather(1, slot // block_size) * block_size + slot % block_size, tables


def extent_index(starts: torch.Tensor, kv_lens: list[int]) -> torch.Tensor:
    """[B, max kv_len] `kv_index` of contiguous extents: start_b + slot, start_b past kv_len."""
    slot = torch.arange(max(kv_lens), device=starts.device)[None, :]
    lens = torch.tensor(kv_lens, device=starts.device)[:, None]
    return starts.to(torch.int64)[:, None] + torch.where(slot < lens, slot, 0)


def _table_of(chunk: SequenceChunk, kv_len: int, block_size: int, num_blocks: int) -> list[int]:
    """A chunk's block table, padded to `num_blocks` with its first block."""
    if chunk.blocks is None:
        raise ValueError("one forward batch cannot mix paged sequences and contiguous extents")
    if chunk.block_size != block_size or len(chunk.blocks) * block_size < kv_len:
        raise ValueError(
            f"a paged chunk needs blocks of {block_size} slots covering its {kv_len} slots; "
            f"it has {len(chunk.blocks)} of {chunk.block_size}"
        )
    return chunk.blocks + [chunk.blocks[0]] * (num_blocks - len(chunk.blocks))


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
