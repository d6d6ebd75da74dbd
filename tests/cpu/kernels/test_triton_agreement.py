"""Every Triton kernel agrees with its torch reference on random inputs.

Here on CPU under TRITON_INTERPRET=1 (see conftest.py); tests/gpu runs these same functions
on CUDA with compiled kernels by overriding the `device` fixture. Shapes stay small: the
interpreter runs a program's ops through numpy one at a time.
"""

import pytest
import torch
from kernels_testlib import random_trees

from outrider.kernels.kv_compaction import compact_kv, extent_slot_map
from outrider.kernels.logits_processing import process_logits
from outrider.kernels.tree_buffers import build_tree_buffers
from outrider.kernels.verification import draw_verify_randoms, verify


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
    slot_map = extent_slot_map(torch.tensor([0, 5, 10, 12], device=device), 13)
    slot_map[3] = slot_map[3].flip(0)  # a scattered (paged) map: any one-to-one map is allowed
    ref = cache.clone()
    compact_kv(ref, accepted, slot_map, slot_dim=dim, backend="torch")
    compact_kv(cache, accepted, slot_map, slot_dim=dim, backend=triton_backend)
    assert torch.equal(ref, cache)


@pytest.mark.parametrize(("seed", "vocab"), [(0, 1000), (1, 3000), (2, 37)])
def test_logits_processing(triton_backend: str, device: str, seed: int, vocab: int) -> None:
    """Mixed per-row parameters: greedy rows, and top-k / top-p / min-p each on or off.

    Random (tie-free) logits: at a top-k or top-p cut the reference keeps whichever tied
    tokens its sort ranks first and the kernel keeps them all; without ties both are exact.
    """
    gen = torch.Generator().manual_seed(seed)
    rows = 6
    logits = torch.randn(rows, vocab, generator=gen) * 3
    temperature = torch.tensor([0.0, 1.0, 0.7, 1.3, 0.0, 0.9])
    top_k = torch.tensor([5, 0, 20, vocab, 3, 40])  # 0 and vocab: off
    top_p = torch.tensor([0.9, 0.8, 1.0, 0.5, 1.0, 0.95])  # 1: off
    min_p = torch.tensor([0.0, 0.05, 0.1, 0.0, 0.2, 0.02])  # 0: off
    args = [t.to(device) for t in (logits, temperature, top_k, top_p, min_p)]
    ref = process_logits(*args, backend="torch")
    got = process_logits(*args, backend=triton_backend)
    assert torch.equal(ref > 0, got > 0)  # the same tokens survive
    assert torch.allclose(ref, got, atol=1e-6, rtol=1e-5)
    assert torch.equal(got[0] > 0, torch.nn.functional.one_hot(logits[0].argmax(), vocab).to(device) > 0)
    # Each filter alone, and none, in a batch of its own (the reference skips a filter that no row uses).
    for kwargs in ({}, {"top_k": args[2]}, {"top_p": args[3]}, {"min_p": args[4]}):
        ref = process_logits(args[0], args[1], backend="torch", **kwargs)
        got = process_logits(args[0], args[1], backend=triton_backend, **kwargs)
        assert torch.equal(ref > 0, got > 0), kwargs
        assert torch.allclose(ref, got, atol=1e-6, rtol=1e-5), kwargs


def test_logits_processing_keeps_all_ties_at_a_cut(triton_backend: str, device: str) -> None:
    """The kernel's tie rule (the reference instead keeps whichever tied tokens sort first)."""
    logits = torch.tensor([[3.0, 1.0, 2.0, 2.0, 0.0], [1.0, 1.0, 1.0, 1.0, 0.0]], device=device)
    probs = process_logits(
        logits,
        torch.ones(2, device=device),
        top_k=torch.tensor([2, 1], device=device),
        backend=triton_backend,
    )
    assert (probs > 0).tolist() == [[True, False, True, True, False], [True, True, True, True, False]]
