"""KV cache: committing an accepted tree path, and bounded admission."""

from __future__ import annotations

import pytest
import torch
from target_runner_testlib import reference_logits

from outrider.kernels.kv_compaction import extent_slot_map
from outrider.target_worker.batch import SequenceChunk, build_forward_batch
from outrider.target_worker.kv_cache import CacheFullError, KVCache, KVSpec
from outrider.target_worker.runner import ModelRunner

PARENTS = [-1, 0, 0, 1, 2, 2, 4, 3]  # node 0 = root; parents precede children


# Paged layout for the two sequences: 4-slot blocks scattered (and interleaved) over the cache.
TABLES = [[9, 2, 14, 5, 0], [7, 11, 3, 12, 1]]


def _chunk(paged: bool, seq: int, start: int, context: int, tokens: torch.Tensor, **kw) -> SequenceChunk:
    if paged:
        return SequenceChunk(-1, context, tokens, blocks=TABLES[seq], block_size=4, **kw)
    return SequenceChunk(start, context, tokens, **kw)


@pytest.mark.parametrize("paged", [False, True], ids=["extents", "paged"])
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_commit_path_then_decode_equals_recompute(family, paged, checkpoints):
    """Two trees verified in one forward, paths committed, then one decode step each:
    logits equal a from-scratch forward of the committed tokens (and transformers), with
    contiguous extents and with scattered block tables alike."""
    path, model = checkpoints[family]
    runner = ModelRunner.from_pretrained(path, max_model_len=48)
    gen = torch.Generator().manual_seed(5)
    vocab = model.config.vocab_size
    contexts = [torch.randint(0, vocab, (n,), generator=gen) for n in (6, 3)]
    starts = [-1, -1] if paged else [runner.cache.allocate(seq, 32) for seq in range(2)]
    runner.forward(build_forward_batch([_chunk(paged, b, starts[b], 0, contexts[b]) for b in range(2)]))

    trees = [torch.randint(0, vocab, (len(PARENTS),), generator=gen) for _ in range(2)]
    parents = torch.tensor(PARENTS)
    batch = build_forward_batch(
        [_chunk(paged, b, starts[b], len(contexts[b]), trees[b], parents=parents) for b in range(2)]
    )
    runner.forward(batch)
    # Sequence 0 accepts root -> 2 -> 4 -> 6 (rows move); sequence 1 accepts root -> 1 (no move).
    accepted = torch.tensor([[2, 4, 6], [1, -1, -1]])
    slot_map = batch.cache_rows.view(2, len(PARENTS))  # each tree's nodes' rows, root first
    if not paged:
        assert torch.equal(slot_map, extent_slot_map(torch.tensor([starts[0] + 6, starts[1] + 3]), 8))
    runner.cache.compact(accepted, slot_map)

    committed = [
        contexts[0].tolist() + trees[0][[0, 2, 4, 6]].tolist(),
        contexts[1].tolist() + trees[1][[0, 1]].tolist(),
    ]
    bonus = [int(torch.randint(0, vocab, (1,), generator=gen)) for _ in range(2)]
    decode = [_chunk(paged, b, starts[b], len(committed[b]), torch.tensor([bonus[b]])) for b in range(2)]
    after_commit = runner.forward(build_forward_batch(decode)).logits

    fresh = ModelRunner.from_pretrained(path, max_model_len=48)
    for seq in range(2):
        tokens = committed[seq] + [bonus[seq]]
        start = fresh.cache.allocate(seq, 32)
        scratch = fresh.forward(build_forward_batch([SequenceChunk(start, 0, torch.tensor(tokens))])).logits[
            0
        ]
        assert (after_commit[seq] - scratch).abs().max() <= 1e-4
        assert (after_commit[seq] - reference_logits(model, tokens)).abs().max() <= 1e-4


def _spec() -> KVSpec:
    return KVSpec(num_layers=2, buffers=(("k", (1, 4)), ("v", (1, 4))), dtype=torch.float32)


def test_admission_refuses_what_does_not_fit():
    cache = KVCache(_spec(), total_rows=100)
    assert cache.allocate(1, 40) == 0
    assert cache.allocate(2, 40) == 40
    with pytest.raises(CacheFullError, match="sequence 3 needs 30 contiguous KV rows; 20 of 100 are free"):
        cache.allocate(3, 30)
    with pytest.raises(CacheFullError, match="the whole cache holds 100"):
        cache.allocate(4, 101)
    cache.free(1)
    # The freed hole is reused first-fit; its remainder and the tail stay separate holes.
    assert cache.allocate(3, 30) == 0
    assert cache.largest_free_extent == 20
    cache.free(2)
    cache.free(3)
    assert cache.free_rows == 100 and cache.largest_free_extent == 100  # neighbours coalesce
    assert cache.allocate(5, 100) == 0


def test_rows_for_budget():
    spec = _spec()
    assert spec.bytes_per_row() == 2 * 2 * 4 * 4  # layers * (k + v) * elements * fp32
    assert KVCache.rows_for_budget(spec, 64 * 1000) == 1000


def test_forward_refuses_rows_past_the_extent(checkpoints):
    path, _ = checkpoints["mistral"]
    runner = ModelRunner.from_pretrained(path, max_model_len=16)
    start = runner.cache.allocate(0, 8)
    with pytest.raises(ValueError, match="needs 9 rows but was admitted with 8"):
        runner.forward(build_forward_batch([SequenceChunk(start, 0, torch.arange(9))]))
    with pytest.raises(ValueError, match="max_model_len is 16"):
        runner.forward(build_forward_batch([SequenceChunk(start, 10, torch.arange(7))]))
