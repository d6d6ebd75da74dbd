"""Temperature, top-k, top-p and min-p, per row."""

import torch

from outrider.kernels.logits_processing import process_logits

LOGITS = torch.log(torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]] * 2))


def test_temperature_one_is_softmax_and_zero_is_one_hot() -> None:
    probs = process_logits(LOGITS, torch.tensor([1.0, 0.0]))
    assert torch.allclose(probs[0], torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05]))
    assert probs[1].tolist() == [1.0, 0.0, 0.0, 0.0, 0.0]


def test_top_k_per_row() -> None:
    probs = process_logits(LOGITS, torch.ones(2), top_k=torch.tensor([2, 0]))
    assert torch.allclose(probs[0], torch.tensor([5 / 7, 2 / 7, 0, 0, 0]))
    assert torch.allclose(probs[1], torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05]))


def test_top_p_keeps_the_smallest_prefix_reaching_p() -> None:
    probs = process_logits(LOGITS, torch.ones(2), top_p=torch.tensor([0.7, 0.71]))
    assert (probs[0] > 0).tolist() == [True, True, False, False, False]
    assert (probs[1] > 0).tolist() == [True, True, True, False, False]
    assert torch.allclose(probs.sum(-1), torch.ones(2))


def test_top_p_applies_to_the_top_k_distribution() -> None:
    # top-k 3 renormalises to [0.588, 0.235, 0.176]: top-p 0.8 then keeps two tokens.
    probs = process_logits(LOGITS, torch.ones(2), top_k=torch.tensor([3, 3]), top_p=torch.tensor([0.8, 1.0]))
    assert (probs[0] > 0).sum() == 2 and (probs[1] > 0).sum() == 3


def test_min_p_is_relative_to_the_top_token() -> None:
    probs = process_logits(LOGITS, torch.ones(2), min_p=torch.tensor([0.3, 0.0]))
    assert (probs[0] > 0).tolist() == [True, True, True, False, False]
    assert (probs[1] > 0).all()


def test_top_p_one_is_off_even_beside_a_row_that_truncates() -> None:
    # fp32 cumsum rounding must not trim the tail of a top_p = 1 row in a mixed batch.
    logits = torch.randn(2, 3000, generator=torch.Generator().manual_seed(0)) * 3
    probs = process_logits(logits, torch.ones(2), top_p=torch.tensor([0.5, 1.0]))
    assert (probs[1] > 0).all() and (probs[0] > 0).sum() < 3000
