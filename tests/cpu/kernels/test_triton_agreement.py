"""Every Triton kernel agrees with its torch reference on random inputs.

Here on CPU under TRITON_INTERPRET=1 (see conftest.py); tests/gpu runs these same functions
on CUDA with compiled kernels by overriding the `device` fixture. Shapes stay small: the
interpreter runs a program's ops through numpy one at a time.
"""

import pytest
import torch
from kernels_testlib import random_trees

from kernels.kv_compaction import compact_kv
from kernels.tree_buffers import build_tree_buffers
from kernels.verification import draw_verify_randoms, verify


@pytest.fixture
def device() -> str:
    return "cpu"


@pytest.mark.parametrize("seed", range(3))
def test_tree_buffers(triton_backend: str, device: str, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    trees = random_trees(gen, batch=5, max_nodes=9, vocab=4, q_top_k=1).to(device)
    context = torch.randint(0, 50, (5,), generator=gen).to(device)
    ref = build_tree_buffers(trees.parents, trees.cu_num_draft_tokens, context, backend="torch")
    got = build_tree_buffers(trees.parents, trees.cu_num_draft_tokens, context, backend=triton_backend)
    for name in ("positions", "depths", "tree_mask", "retrieve_paths"):
        assert torch.equal(getattr(ref, name), getattr(got, name)), name


@pytest.mark.parametrize(("seed", "vocab"), [(0, 16), (1, 37), (2, 1500), (3, 5), (4, 9)])
def test_verify_same_samples_from_the_same_randoms(
    triton_backend: str, device: str, seed: int, vocab: int
) -> None:
    gen = torch.Generator().manual_seed(seed)
    batch = 12
    bias = torch.randn(vocab, vocab, generator=gen) * 3
    trees = random_trees(gen, batch, max_nodes=8, vocab=vocab, q_top_k=5, greedy_bias=bias)
    probs = (bias[trees.token_ids] + torch.randn(trees.token_ids.numel(), vocab, generator=gen)).softmax(-1)
    is_greedy = torch.rand(batch, generator=gen) < 0.3
    randoms = draw_verify_randoms(trees.cu_num_draft_tokens, vocab, gen)
    trees, probs, is_greedy = trees.to(device), probs.to(device), is_greedy.to(device)
    randoms.uniforms, randoms.exponentials = randoms.uniforms.to(device), randoms.exponentials.to(device)
    ref = verify(trees, probs, is_greedy, randoms, backend="torch")
    got = verify(trees, probs, is_greedy, randoms, backend=triton_backend)
    assert torch.equal(ref.num_output_tokens, got.num_output_tokens)
    assert torch.equal(ref.accepted_node_ids, got.accepted_node_ids)
    assert torch.equal(ref.output_token_ids, got.output_token_ids)
    assert int(ref.num_output_tokens.sum()) > batch  # some drafts were accepted


@pytest.mark.parametrize(("shape", "dim"), [((2, 2, 30, 2, 3), 2), ((30, 1100), 0)])
def test_kv_compaction(triton_backend: str, device: str, shape: tuple[int, ...], dim: int) -> None:
    gen = torch.Generator().manual_seed(0)
    cache = torch.randn(shape, generator=gen).to(device)
    accepted = torch.tensor([[2, 5, 6, -1], [1, 2, 3, 4], [-1, -1, -1, -1], [3, 4, 9, 12]], device=device)
    roots = torch.tensor([0, 5, 10, 12], device=device)
    ref = cache.clone()
    compact_kv(ref, accepted, roots, slot_dim=dim, backend="torch")
    compact_kv(cache, accepted, roots, slot_dim=dim, backend=triton_backend)
    assert torch.equal(ref, cache)
