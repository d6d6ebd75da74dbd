"""Triton kernel for `process_logits`: one program per row, no sort.

top-k and top-p both keep a *suffix of the value order*: token x stays iff the weight of the
tokens strictly above it is under a budget (count < k for top-k; top-k probability mass < p
for top-p). That weight is non-increasing in the threshold, so each cut is a threshold found
by bisection, counting or summing over the row per step, as GPU samplers do to avoid a sort.
The bisection runs over the fp32 bit patterns mapped to order-preserving int32 keys:

    float  -inf .. -1.0 .. -0.0 | +0.0 .. 1.0 .. +inf
    bits   0xFF800000 .. 0x80000000 | 0x00000000 .. 0x7F800000
    key    bits ^ 0x7FFFFFFF (negatives) | bits (non-negatives)   -> monotone in int32

so at most 32 steps find the exact cut (no tolerance), each step one pass over the row in
BLOCK_V chunks. The top token always stays (as in the reference, whose first sorted token is
never masked). Ties at a cut are all kept: the reference keeps whichever tied tokens its sort
puts first, so the two agree whenever the values at the cut are distinct.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from outrider.kernels.backend import next_power_of_2


@triton.jit
def _load_scaled(row_ptr, offs, VOCAB, temp):
    """Temperature-scaled fp32 logits of one chunk, and their order keys; padding is -inf.

    A true division (not a multiply by 1 / temp) so the values match the reference's bit for bit.
    """
    x = tl.load(row_ptr + offs, mask=offs < VOCAB, other=float("-inf")).to(tl.float32) / temp
    bits = x.to(tl.int32, bitcast=True)
    key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.int64)
    return x, key


@triton.jit
def _weight_above(row_ptr, VOCAB, temp, row_max, floor_key, t, COUNT: tl.constexpr, BLOCK_V: tl.constexpr):
    """Sum over tokens with key > t (and key >= floor_key) of 1 (COUNT) or exp(x - row_max)."""
    total = 0.0
    for off in range(0, VOCAB, BLOCK_V):
        offs = off + tl.arange(0, BLOCK_V)
        x, key = _load_scaled(row_ptr, offs, VOCAB, temp)
        above = (offs < VOCAB) & (key > t) & (key >= floor_key)
        if COUNT:
            w = tl.where(above, 1.0, 0.0)
        else:
            w = tl.where(above, tl.exp(x - row_max), 0.0)
        total += tl.sum(w, axis=0)
    return total


@triton.jit
def _cut(
    row_ptr, VOCAB, temp, row_max, floor_key, lo, hi, budget, COUNT: tl.constexpr, BLOCK_V: tl.constexpr
):
    """Smallest key t in (lo, hi] with weight_above(t) < budget (hi, the top token, always qualifies).

    With COUNT the weight is a count and budget = k; otherwise it is probability mass relative to
    `budget` = p * (sum of exp(x - row_max) over key >= floor_key).
    """
    while hi - lo > 1:
        mid = lo + ((hi - lo) >> 1)
        if _weight_above(row_ptr, VOCAB, temp, row_max, floor_key, mid, COUNT, BLOCK_V) < budget:
            hi = mid
        else:
            lo = mid
    return hi


@triton.jit
def _process_logits_kernel(
    probs_ptr,  # [num_rows, VOCAB] float32, mutable
    logits_ptr,  # [num_rows, VOCAB] any float dtype
    temperature_ptr,  # [num_rows] float32; <= 0 = greedy
    top_k_ptr,  # [num_rows] int64; <= 0 or >= VOCAB = off
    top_p_ptr,  # [num_rows] float32; >= 1 = off
    min_p_ptr,  # [num_rows] float32; <= 0 = off
    VOCAB,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    logits_row = logits_ptr + row * VOCAB
    probs_row = probs_ptr + row * VOCAB
    temp = tl.load(temperature_ptr + row)
    greedy = temp <= 0
    temp = tl.where(greedy, 1.0, temp)
    top_k = tl.load(top_k_ptr + row)
    top_p = tl.load(top_p_ptr + row)
    min_p = tl.load(min_p_ptr + row)

    # Pass 1: max (first index on ties, like torch.argmax) and the key range.
    row_max = float("-inf")
    arg_max = 0
    key_min = tl.full((), 0x7FFFFFFF, tl.int64)
    for off in range(0, VOCAB, BLOCK_V):
        offs = off + tl.arange(0, BLOCK_V)
        x, key = _load_scaled(logits_row, offs, VOCAB, temp)
        block_max = tl.max(x, axis=0)
        block_arg = tl.argmax(x, axis=0, tie_break_left=True)
        arg_max = tl.where(block_max > row_max, off + block_arg, arg_max)
        row_max = tl.maximum(row_max, block_max)
        key_min = tl.minimum(key_min, tl.min(tl.where(offs < VOCAB, key, 0x7FFFFFFF), axis=0))
    max_bits = row_max.to(tl.int32, bitcast=True)
    key_max = tl.where(max_bits >= 0, max_bits, max_bits ^ 0x7FFFFFFF).to(tl.int64)

    if greedy:
        for off in range(0, VOCAB, BLOCK_V):
            offs = off + tl.arange(0, BLOCK_V)
            tl.store(probs_row + offs, tl.where(offs == arg_max, 1.0, 0.0), mask=offs < VOCAB)
    else:
        # Keep key >= cut: the top-k cut, then the top-p cut over the top-k renormalised mass.
        cut = key_min
        if (top_k > 0) & (top_k < VOCAB):
            cut = _cut(
                logits_row,
                VOCAB,
                temp,
                row_max,
                cut,
                key_min - 1,
                key_max,
                top_k.to(tl.float32),
                True,
                BLOCK_V,
            )
        if top_p < 1:
            mass_k = _weight_above(logits_row, VOCAB, temp, row_max, cut, cut - 1, False, BLOCK_V)
            cut = _cut(
                logits_row, VOCAB, temp, row_max, cut, cut - 1, key_max, top_p * mass_k, False, BLOCK_V
            )
        # softmax over the kept tokens: exp(x - max) / z, the top token's probability is 1 / z.
        z = _weight_above(logits_row, VOCAB, temp, row_max, cut, cut - 1, False, BLOCK_V)
        use_min_p = min_p > 0
        floor = min_p * (1.0 / z)
        kept_mass = 1.0
        if use_min_p:
            kept_mass = 0.0
            for off in range(0, VOCAB, BLOCK_V):
                offs = off + tl.arange(0, BLOCK_V)
                x, key = _load_scaled(logits_row, offs, VOCAB, temp)
                p = tl.where((offs < VOCAB) & (key >= cut), tl.exp(x - row_max) / z, 0.0)
                kept_mass += tl.sum(tl.where(p >= floor, p, 0.0), axis=0)
        for off in range(0, VOCAB, BLOCK_V):
            offs = off + tl.arange(0, BLOCK_V)
            x, key = _load_scaled(logits_row, offs, VOCAB, temp)
            p = tl.where(key >= cut, tl.exp(x - row_max) / z, 0.0)
            if use_min_p:
                p = tl.where(p >= floor, p, 0.0) / kept_mass
            tl.store(probs_row + offs, p, mask=offs < VOCAB)


def process_logits_triton(
    logits: torch.Tensor,  # [num_rows, vocab] any float dtype
    temperature: torch.Tensor,  # [num_rows] float; 0 = greedy
    top_k: torch.Tensor | None = None,  # [num_rows] int
    top_p: torch.Tensor | None = None,  # [num_rows] float
    min_p: torch.Tensor | None = None,  # [num_rows] float
) -> torch.Tensor:  # [num_rows, vocab] float32
    """Same contract as `logits_processing._process_logits_reference`."""
    num_rows, vocab = logits.shape
    device = logits.device
    probs = torch.empty(num_rows, vocab, dtype=torch.float32, device=device)
    if num_rows == 0 or vocab == 0:
        return probs
    off = torch.zeros(num_rows, device=device)
    _process_logits_kernel[(num_rows,)](
        probs,
        logits.contiguous(),
        temperature.float().expand(num_rows).contiguous(),
        (off if top_k is None else top_k).long().expand(num_rows).contiguous(),
        (off + 1 if top_p is None else top_p).float().expand(num_rows).contiguous(),
        (off if min_p is None else min_p).float().expand(num_rows).contiguous(),
        vocab,
        BLOCK_V=min(next_power_of_2(vocab), 4096),
        num_warps=8 if vocab >= 2048 else 4,
    )
    return probs
