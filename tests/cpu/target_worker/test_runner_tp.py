"""Tensor parallelism on CPU: two gloo ranks give the same logits as one process."""

from __future__ import annotations

import pytest
from target_runner_testlib import save_random_checkpoint, tp_rank_check

from outrider.target_worker.parallel import TPGroup, launch


def test_tp2_gloo_equals_tp1(tmp_path):
    paths = []
    # Sharded KV heads (2 over 2 ranks) with o/down biases added once; replicated KV heads
    # (1 KV head on 2 ranks) with q/k norm; q/k/v bias with a tied head. Vocab 97 is uneven.
    for family, overrides in [
        ("llama", dict(attention_bias=True, mlp_bias=True)),
        ("qwen3", dict(num_key_value_heads=1)),
        ("qwen2", dict()),
    ]:
        path = tmp_path / family
        save_random_checkpoint(path, family, **overrides)
        paths.append(str(path))
    launch(tp_rank_check, world_size=2, args=(paths, 1e-4), backend="gloo")


def test_kv_head_split():
    # 8 query heads, 2 KV heads on 4 ranks: each KV head replicated on two ranks.
    assert [TPGroup(rank=r, world_size=4).kv_head_range(8, 2) for r in range(4)] == [
        (0, 1),
        (0, 1),
        (1, 2),
        (1, 2),
    ]
    assert TPGroup(rank=1, world_size=2).kv_head_range(8, 4) == (2, 4)
    with pytest.raises(ValueError, match="num_key_value_heads = 3"):
        TPGroup(rank=0, world_size=2).kv_head_range(6, 3)
    with pytest.raises(ValueError, match="num_attention_heads = 6 is not divisible"):
        TPGroup(rank=0, world_size=4).kv_head_range(6, 2)


def test_vocab_split_is_padded():
    # 97 rows over 2 ranks: 49 + 48, the head pads rank 1 to 49 so all-gather sizes match.
    assert TPGroup(rank=0, world_size=2).padded_range(97) == (0, 49, 49)
    assert TPGroup(rank=1, world_size=2).padded_range(97) == (49, 97, 49)
