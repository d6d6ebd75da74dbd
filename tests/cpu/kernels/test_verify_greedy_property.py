"""Greedy verification is token-identical to plain greedy decoding, for any drafter."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kernels_testlib import random_trees

from outrider.kernels.verification import verify

VOCAB = 12


def greedy_decode(next_logits: torch.Tensor, root: int, steps: int) -> list[int]:
    out, last = [], root
    for _ in range(steps):
        last = int(next_logits[last].argmax())
        out.append(last)
    return out


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), batch=st.integers(2, 6), max_nodes=st.integers(1, 12))
def test_greedy_tree_verification_equals_greedy_decoding(seed: int, batch: int, max_nodes: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    # Markov target: the next token depends on the last one only, so the target's
    # distribution after node i is row token_ids[i] of this table.
    next_logits = torch.randn(VOCAB, VOCAB, generator=gen)
    trees = random_trees(gen, batch, max_nodes, VOCAB, q_top_k=4, greedy_bias=next_logits)
    probs = next_logits[trees.token_ids].softmax(-1)
    out = verify(trees, probs, torch.ones(batch, dtype=torch.bool))
    for b in range(batch):
        n_out = int(out.num_output_tokens[b])
        root = int(trees.token_ids[trees.cu_num_draft_tokens[b]])
        assert out.output_token_ids[b, :n_out].tolist() == greedy_decode(next_logits, root, n_out)
        # Longest match: the walk stops only where no child carries the greedy token.
        last = int(out.accepted_node_ids[b, n_out - 2]) if n_out > 1 else 0
        start = int(trees.cu_num_draft_tokens[b])
        kids = (trees.parents[start : int(trees.cu_num_draft_tokens[b + 1])] == last).nonzero().squeeze(1)
        assert int(out.output_token_ids[b, n_out - 1]) not in trees.token_ids[start + kids].tolist()


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), batch=st.integers(1, 6), max_nodes=st.integers(1, 16))
def test_greedy_host_scan_equals_the_vectorised_walk(seed: int, batch: int, max_nodes: int) -> None:
    """The all-greedy CPU fast path returns exactly the reference walk's tensors, duplicate
    sibling tokens (the first in node order wins) and root-only trees included."""
    from outrider.kernels.verification import draw_verify_randoms, verify_host, verify_reference

    gen = torch.Generator().manual_seed(seed)
    next_logits = torch.randn(VOCAB // 3, VOCAB, generator=gen).repeat(3, 1)  # ties between tokens
    trees = random_trees(gen, batch, max_nodes, VOCAB, q_top_k=4, greedy_bias=next_logits)
    probs = next_logits[trees.token_ids].softmax(-1)
    greedy = torch.ones(batch, dtype=torch.bool)
    randoms = draw_verify_randoms(trees.cu_num_draft_tokens, VOCAB, gen)
    fast, slow = verify_host(trees, probs, greedy, randoms), verify_reference(trees, probs, greedy, randoms)
    assert torch.equal(fast.accepted_node_ids, slow.accepted_node_ids)
    assert torch.equal(fast.output_token_ids, slow.output_token_ids)
    assert torch.equal(fast.num_output_tokens, slow.num_output_tokens)
