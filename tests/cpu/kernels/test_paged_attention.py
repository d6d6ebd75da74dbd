"""Paged attention of a ragged batch (prefill chunk, decodes, a tree) against one SDPA per
sequence over its rows, and the Triton kernel (interpreted here) against the reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from outrider.kernels.paged_attention import paged_attention

BLOCK = 4
PARENTS = [-1, 0, 0, 1, 2]  # a 5-node tree


def _batch(gen: torch.Generator, heads: int, kv_heads: int, dim: int):
    """Three sequences: a prefill chunk of 6 after 3 cached, one decode after 9, and a tree
    after 7; blocks scattered over a 40-block cache."""
    rows = 40 * BLOCK
    k_cache, v_cache = (
        torch.randn(rows, kv_heads, dim, generator=gen),
        torch.randn(rows, kv_heads, dim, generator=gen),
    )
    tables = torch.randperm(40, generator=gen)[:15].view(3, 5)
    contexts, sizes = [3, 9, 7], [6, 1, len(PARENTS)]
    token_seq = torch.repeat_interleave(torch.arange(3), torch.tensor(sizes))
    limit, tree_start, tree_rows = [], [], []
    ancestors = torch.zeros(len(PARENTS), len(PARENTS), dtype=torch.bool)
    for i, p in enumerate(PARENTS):
        ancestors[i, i] = True
        if p >= 0:
            ancestors[i] |= ancestors[p]
    for b, (ctx, n) in enumerate(zip(contexts, sizes, strict=True)):
        for i in range(n):
            tree = b == 2
            limit.append(ctx if tree else ctx + i + 1)
            tree_start.append(ctx)
            tree_rows.append(ancestors[i] if tree else torch.zeros(len(PARENTS), dtype=torch.bool))
    q = torch.randn(len(limit), heads, dim, generator=gen)
    meta = (tables, BLOCK, token_seq, torch.tensor(limit), torch.tensor(tree_start), torch.stack(tree_rows))
    return q, k_cache, v_cache, meta, contexts, sizes


def _per_sequence(q, k_cache, v_cache, meta, contexts, sizes) -> torch.Tensor:
    tables, block, _, _, _, tree_mask = meta
    out, start = [], 0
    group = q.shape[1] // k_cache.shape[1]
    for b, (ctx, n) in enumerate(zip(contexts, sizes, strict=True)):
        slots = torch.arange(ctx + n)
        rows = tables[b][slots // block] * block + slots % block
        k = k_cache[rows].repeat_interleave(group, 1).transpose(0, 1)[None]
        v = v_cache[rows].repeat_interleave(group, 1).transpose(0, 1)[None]
        if b == 2:
            mask = torch.cat([torch.ones(n, ctx, dtype=torch.bool), tree_mask[start : start + n, :n]], 1)
        else:
            mask = torch.ones(n, ctx + n, dtype=torch.bool).tril(ctx)
        qs = q[start : start + n].transpose(0, 1)[None]
        out.append(F.scaled_dot_product_attention(qs, k, v, attn_mask=mask)[0].transpose(0, 1))
        start += n
    return torch.cat(out)


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(4, 2, 16), (2, 2, 12)])
def test_reference_is_attention_over_each_sequences_rows(heads, kv_heads, dim):
    q, k, v, meta, contexts, sizes = _batch(torch.Generator().manual_seed(heads + dim), heads, kv_heads, dim)
    got = paged_attention(q, k, v, *meta, backend="torch")
    assert torch.allclose(got, _per_sequence(q, k, v, meta, contexts, sizes), atol=1e-5)


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(4, 2, 16), (2, 2, 12)])
def test_triton_kernel_matches_the_reference(triton_backend, heads, kv_heads, dim):
    q, k, v, meta, _, _ = _batch(torch.Generator().manual_seed(heads + dim), heads, kv_heads, dim)
    ref = paged_attention(q, k, v, *meta, backend="torch")
    got = paged_attention(q, k, v, *meta, backend=triton_backend)
    assert torch.allclose(got, ref, atol=1e-5)


def test_a_model_forward_through_the_kernel_equals_the_grouped_path(triton_backend, tmp_path, monkeypatch):
    """A paged ragged batch (prefill chunk, decode, tree) through a Llama runner: the logits
    with the Triton kernel (what CUDA runs) equal the grouped SDPA path's (what CPU runs)."""
    from target_runner_testlib import save_random_checkpoint

    from outrider.target_worker.batch import SequenceChunk, build_forward_batch
    from outrider.target_worker.layers.attention import plan_attention
    from outrider.target_worker.runner import ModelRunner

    save_random_checkpoint(tmp_path, "llama", num_hidden_layers=1)  # the interpreter is slow
    runner = ModelRunner.from_pretrained(tmp_path, max_model_len=64, kv_cache_rows=256)
    gen = torch.Generator().manual_seed(3)
    tables = torch.randperm(64, generator=gen)[:15].view(3, 5).tolist()
    prompts = [torch.randint(0, 97, (n,), generator=gen) for n in (5, 9, 7)]
    first = [
        SequenceChunk(-1, 0, p, blocks=t, block_size=BLOCK) for p, t in zip(prompts, tables, strict=True)
    ]
    runner.forward(build_forward_batch(first))
    batch = build_forward_batch(
        [
            SequenceChunk(
                -1, 5, torch.randint(0, 97, (6,), generator=gen), blocks=tables[0], block_size=BLOCK
            ),
            SequenceChunk(
                -1, 9, torch.randint(0, 97, (1,), generator=gen), blocks=tables[1], block_size=BLOCK
            ),
            SequenceChunk(
                -1,
                7,
                torch.randint(0, 97, (5,), generator=gen),
                torch.tensor(PARENTS),
                True,
                tables[2],
                BLOCK,
            ),
        ]
    )
    grouped = runner.forward(batch).logits
    monkeypatch.setenv("OUTRIDER_KERNEL_BACKEND", triton_backend)
    assert plan_attention(batch).paged is not None
    kernel = runner.forward(batch).logits
    assert torch.allclose(kernel, grouped, atol=1e-4)


def test_one_sequence_in_consecutive_blocks_is_read_as_a_view_with_the_same_result():
    from outrider.target_worker.batch import SequenceChunk, build_forward_batch
    from outrider.target_worker.layers.attention import plan_attention, ragged_attention

    gen = torch.Generator().manual_seed(3)
    k_cache, v_cache = torch.randn(96, 2, 8, generator=gen), torch.randn(96, 2, 8, generator=gen)
    k_cache[80:], v_cache[80:] = k_cache[48:64], v_cache[48:64]  # block 5 holds what block 3 does
    outputs = []
    for table in ([2, 3, 4], [2, 5, 4]):  # consecutive: a view; scattered: the block gather
        chunk = SequenceChunk(-1, 37, torch.tensor([5, 6]), blocks=table, block_size=16)
        plan = plan_attention(build_forward_batch([chunk]))
        assert (plan.groups[0].kv_start >= 0) == (table == [2, 3, 4])
        q = torch.randn(2, 4, 8, generator=torch.Generator().manual_seed(4))
        outputs.append(ragged_attention(q, k_cache, v_cache, plan))
    torch.testing.assert_close(outputs[0], outputs[1])
