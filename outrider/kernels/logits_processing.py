"""Logits -> probabilities under per-row sampling parameters, shared by target and draft.

p and q must come out of the *same* processing for verification to be lossless, so both
workers call this one function. Order (as vLLM): temperature, top-k, top-p on the top-k
renormalised distribution, then min-p (keep tokens with prob >= min_p * max prob; min-p
commutes with renormalisation, so its place in the order does not matter). Rows with
temperature 0 are greedy and come out as a one-hot argmax (first index on ties).

Disabled values: top_k <= 0 or >= vocab, top_p >= 1, min_p <= 0.

Two implementations, same signature, picked by `backend` (outrider/kernels/backend.py; auto = Triton
on CUDA, torch elsewhere): the torch reference below sorts the vocabulary;
`logits_processing_triton` finds the top-k and top-p cuts by bisection over the values
instead (no sort). They agree up to float rounding except on ties at a top-k / top-p cut:
the reference keeps whichever tied tokens its sort ranks first, the kernel keeps all of them
(and a token exactly at the min-p floor, where summation order decides either way).
"""

from __future__ import annotations

import torch

from outrider.kernels.backend import Backend, use_triton


def process_logits(
    logits: torch.Tensor,  # [num_rows, vocab] any float dtype
    temperature: torch.Tensor,  # [num_rows] float; 0 = greedy
    top_k: torch.Tensor | None = None,  # [num_rows] int
    top_p: torch.Tensor | None = None,  # [num_rows] float
    min_p: torch.Tensor | None = None,  # [num_rows] float
    backend: Backend | None = None,
) -> torch.Tensor:  # [num_rows, vocab] float32, rows sum to 1
    if use_triton(backend, logits.device):
        from outrider.kernels.logits_processing_triton import process_logits_triton

        return process_logits_triton(logits, temperature, top_k, top_p, min_p)
    return _process_logits_reference(logits, temperature, top_k, top_p, min_p)


def _process_logits_reference(
    logits: torch.Tensor,  # [num_rows, vocab] any float dtype
    temperature: torch.Tensor,  # [num_rows] float; 0 = greedy
    top_k: torch.Tensor | None = None,  # [num_rows] int
    top_p: torch.Tensor | None = None,  # [num_rows] float
    min_p: torch.Tensor | None = None,  # [num_rows] float
) -> torch.Tensor:  # [num_rows, vocab] float32, rows sum to 1
    logits = logits.float()
    vocab = logits.shape[-1]
    greedy = temperature <= 0
    scaled = logits / torch.where(greedy, 1.0, temperature.float())[:, None]
    truncate_k = top_k is not None and bool(((top_k > 0) & (top_k < vocab)).any())
    truncate_p = top_p is not None and bool((top_p < 1).any())
    if truncate_k or truncate_p:
        scaled = _apply_top_k_top_p(scaled, top_k if truncate_k else None, top_p if truncate_p else None)
    probs = scaled.softmax(-1)
    if min_p is not None and bool((min_p > 0).any()):
        keep = probs >= min_p.float()[:, None] * probs.amax(-1, keepdim=True)
        probs = torch.where(keep, probs, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    if bool(greedy.any()):
        one_hot = torch.zeros_like(probs).scatter_(1, logits.argmax(-1, keepdim=True), 1.0)
        probs = torch.where(greedy[:, None], one_hot, probs)
    return probs


def _apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Masks (to -inf) everything outside top-k, then outside the top-p nucleus of what is left."""
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(-1, descending=True)
    rank = torch.arange(vocab, device=logits.device)
    if top_k is not None:
        k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)
        sorted_logits = sorted_logits.masked_fill(rank >= k[:, None], float("-inf"))
    if top_p is not None:
        sorted_probs = sorted_logits.softmax(-1)
        mass_before = sorted_probs.cumsum(-1) - sorted_probs
        # A token stays if the tokens ranked above it hold less than top_p; the first always stays.
        # Rows with top_p >= 1 are off: fp32 cumsum rounding can push mass_before to 1 in the tail.
        outside = (mass_before >= top_p.float()[:, None]) & (rank > 0) & (top_p < 1)[:, None]
        sorted_logits = sorted_logits.masked_fill(outside, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)
