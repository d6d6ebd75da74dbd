"""The CPU host walk (`kernels.verification_host`) is the reference walk: same randoms, same
tokens, for every sampling mode, greedy and sampled rows mixed, root-only trees included."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kernels_testlib import random_trees

from outrider.kernels.verification import draw_verify_randoms, verify, verify_host, verify_reference
from outrider.kernels.verification_host import HOST_MAX_BATCH

VOCAB = 12


@settings(max_examples=150, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    batch=st.integers(1, HOST_MAX_BATCH),
    max_nodes=st.integers(1, 12),
    sharp=st.booleans(),
)
def test_host_walk_equals_the_vectorised_walk(seed: int, batch: int, max_nodes: int, sharp: bool) -> None:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(VOCAB, VOCAB, generator=gen) * (6.0 if sharp else 1.0)  # sharp: long walks
    trees = random_trees(gen, batch, max_nodes, VOCAB, q_top_k=4, greedy_bias=logits)
    probs = logits[trees.token_ids].softmax(-1)
    greedy = torch.rand(batch, generator=gen) < 0.3
    per_seq = [torch.Generator().manual_seed(seed + b) for b in range(batch)]
    randoms = draw_verify_randoms(trees.cu_num_draft_tokens, VOCAB, per_seq)
    if randoms.exponentials is None:  # every tree root-only: verify() never walks
        return
    fast, slow = verify_host(trees, probs, greedy, randoms), verify_reference(trees, probs, greedy, randoms)
    assert torch.equal(fast.accepted_node_ids, slow.accepted_node_ids)
    assert torch.equal(fast.output_token_ids, slow.output_token_ids)
    assert torch.equal(fast.num_output_tokens, slow.num_output_tokens)


def test_verify_walks_small_cpu_batches_on_the_host_and_larger_ones_batched(monkeypatch) -> None:
    """`verify` sends a CPU batch of up to HOST_MAX_BATCH trees with sampled rows to the host
    walk, larger ones to the vectorised walk; all-greedy batches always to the host walk."""
    import outrider.kernels.verification as verification

    calls = []
    for name in ("verify_host", "verify_reference"):
        real = getattr(verification, name)
        monkeypatch.setattr(
            verification, name, lambda *a, _real=real, _name=name: calls.append(_name) or _real(*a)
        )
    gen = torch.Generator().manual_seed(0)
    for batch, all_greedy, expected in (
        (HOST_MAX_BATCH, False, "verify_host"),
        (HOST_MAX_BATCH + 1, False, "verify_reference"),
        (HOST_MAX_BATCH + 1, True, "verify_host"),
    ):
        trees = random_trees(gen, batch, 6, VOCAB, q_top_k=4)
        while trees.max_num_nodes == 1:
            trees = random_trees(gen, batch, 6, VOCAB, q_top_k=4)
        probs = torch.randn(trees.token_ids.numel(), VOCAB, generator=gen).softmax(-1)
        greedy = torch.full((batch,), all_greedy)
        randoms = draw_verify_randoms(trees.cu_num_draft_tokens, VOCAB, gen)
        calls.clear()
        verify(trees, probs, greedy, randoms)
        assert calls == [expected]


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    batch=st.integers(1, HOST_MAX_BATCH + 4),
    all_greedy=st.booleans(),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
)
def test_greedy_rows_take_the_first_of_tied_maxima_in_every_dtype(seed, batch, all_greedy, dtype) -> None:
    """Greedy rows read raw logits on the CPU (`target_probs`), in the model's dtype: the host
    walk's argmax (numpy's where it holds the dtype) picks the first of tied maxima, as the
    vectorised walk's torch.argmax does, whether every row is greedy (no gather) or some."""
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(VOCAB, VOCAB, generator=gen) * 2).round()  # many ties
    trees = random_trees(gen, batch, 6, VOCAB, q_top_k=4, greedy_bias=logits)
    values = logits[trees.token_ids].to(dtype)
    greedy = torch.ones(batch, dtype=torch.bool) if all_greedy else torch.rand(batch, generator=gen) < 0.5
    per_seq = [torch.Generator().manual_seed(seed + b) for b in range(batch)]
    randoms = draw_verify_randoms(trees.cu_num_draft_tokens, VOCAB, per_seq)
    if randoms.exponentials is None or (not all_greedy and batch > HOST_MAX_BATCH):
        return
    probs = values if all_greedy else values.float().softmax(-1)
    fast, slow = verify_host(trees, probs, greedy, randoms), verify_reference(trees, probs, greedy, randoms)
    assert torch.equal(fast.output_token_ids, slow.output_token_ids)
    assert torch.equal(fast.num_output_tokens, slow.num_output_tokens)


def test_a_sampled_root_only_tree_beside_a_drafted_one_draws_by_inverse_cdf() -> None:
    """A batch not all greedy: a sampled sequence verifying its root alone gets its token by
    inverse CDF with its one uniform, as when the whole batch is root-only; an all-greedy batch
    has no such row and skips that step."""
    from outrider.kernels import pack_trees
    from outrider.kernels.verification import VerifyRandoms, verify_roots
    from outrider.proto.tree import CandidateTree, DraftSampling

    def tree(tokens: list[int]) -> CandidateTree:
        n = len(tokens)
        return CandidateTree(
            seq_id=n, round=1, tokens=torch.tensor(tokens), parents=torch.arange(-1, n - 1),
            q_nodes=torch.arange(n - 1), q_token_ids=torch.tensor(tokens[1:]).reshape(n - 1, 1),
            q_probs=torch.ones(n - 1, 1), sampling=DraftSampling.DETERMINISTIC,
        )  # fmt: skip

    trees = pack_trees([tree([1, 2, 3]), tree([4])])
    gen = torch.Generator().manual_seed(0)
    probs = torch.rand(4, VOCAB, generator=gen).softmax(-1)
    randoms = VerifyRandoms(torch.rand(4, generator=gen), torch.rand(2, VOCAB, generator=gen) + 0.1)
    out = verify(trees, probs, torch.tensor([True, False]), randoms)
    root = VerifyRandoms(randoms.uniforms[3:], None)
    expected = verify_roots(probs[3:], torch.tensor([False]), root).output_token_ids[0, 0]
    assert out.output_token_ids[1, 0] == expected and out.num_output_tokens[1] == 1
