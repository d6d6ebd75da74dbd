"""Rank 0 drives, rank 1 follows: a TP=2 greedy loop through LeaderRunner equals TP=1.

The loop exercises every broadcast op: allocate, a ragged prefill, a tree verify with masks,
KV path commits, plain decodes, free and stop.
"""

from __future__ import annotations

import torch

from outrider.kernels.kv_compaction import extent_slot_map
from outrider.target_worker.batch import SequenceChunk, build_forward_batch
from outrider.target_worker.parallel import TPGroup, launch
from outrider.target_worker.parallel.batch_broadcast import BatchBroadcaster, LeaderRunner, follow
from outrider.target_worker.runner import ModelRunner

PROMPTS = [[5, 9, 13, 2, 7], [3, 3, 8]]


def _greedy(runner, steps: int = 4) -> list[list[int]]:
    starts = [runner.cache.allocate(i, 64) for i in range(len(PROMPTS))]
    chunks = [SequenceChunk(s, 0, torch.tensor(p)) for s, p in zip(starts, PROMPTS, strict=True)]
    logits = runner.forward(build_forward_batch(chunks)).logits
    out = [[int(row.argmax())] for row in logits]
    ctx = [len(p) for p in PROMPTS]
    # One tree verify (root + two children under it) for sequence 0, a decode for sequence 1.
    tree = torch.tensor([out[0][0], 11, 12])
    batch = build_forward_batch(
        [
            SequenceChunk(starts[0], ctx[0], tree, parents=torch.tensor([-1, 0, 0])),
            SequenceChunk(starts[1], ctx[1], torch.tensor(out[1][-1:])),
        ]
    )
    logits = runner.forward(batch).logits
    out[0].append(int(logits[0].argmax()))  # the root's next token (children are rejected here)
    out[1].append(int(logits[3].argmax()))
    runner.cache.compact(
        torch.full((2, 1), -1), extent_slot_map(torch.tensor([starts[0] + ctx[0], starts[1] + ctx[1]]), 3)
    )
    ctx = [c + 1 for c in ctx]
    for _ in range(steps):
        chunks = [SequenceChunk(s, c, torch.tensor(o[-1:])) for s, c, o in zip(starts, ctx, out, strict=True)]
        for o, row in zip(out, runner.forward(build_forward_batch(chunks)).logits, strict=True):
            o.append(int(row.argmax()))
        ctx = [c + 1 for c in ctx]
    for i in range(len(PROMPTS)):
        runner.cache.free(i)
    return out


def _rank_main(tp: TPGroup, path: str, expected: list[list[int]]) -> None:
    runner = ModelRunner.from_pretrained(path, max_model_len=128, kv_cache_rows=256, tp=tp)
    broadcaster = BatchBroadcaster(tp)
    if tp.rank == 0:
        leader = LeaderRunner(runner, broadcaster)
        got = _greedy(leader)
        leader.stop_followers()
        assert got == expected, (got, expected)
    else:
        assert follow(runner, broadcaster) == 6


def test_tp2_leader_follower_equals_tp1(tiny_family):
    path = str(tiny_family.target_dir)
    expected = _greedy(ModelRunner.from_pretrained(path, max_model_len=128, kv_cache_rows=256))
    launch(_rank_main, world_size=2, args=(path, expected), backend="gloo")
