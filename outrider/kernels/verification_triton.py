"""Triton kernel for `verify`: one program walks one tree, exactly as `verify_reference`.

Per program state: the current node, the last child tried, the residual r of the current
node (still p's row in `target_probs` until the first rejection there, then materialised in
the `residual` scratch row of this sequence), its mass S, and the working sparse q in
registers. Vocabulary passes go in BLOCK_V chunks.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from outrider.kernels.backend import next_power_of_2
from outrider.kernels.packing import PackedTrees
from outrider.kernels.verification import VerifyOutput, VerifyRandoms, assemble_verify_output
from outrider.proto.tree import DraftSampling


@triton.jit
def _row_sum(row_ptr, VOCAB, BLOCK_V: tl.constexpr):
    total = 0.0
    for off in range(0, VOCAB, BLOCK_V):
        offs = off + tl.arange(0, BLOCK_V)
        total += tl.sum(tl.load(row_ptr + offs, mask=offs < VOCAB, other=0.0), axis=0)
    return total


@triton.jit
def _row_argmax(row_ptr, noise_ptr, VOCAB, USE_NOISE: tl.constexpr, BLOCK_V: tl.constexpr):
    """argmax_v row[v] (/ noise[v]); first index on ties, like torch.argmax."""
    best = -1.0
    best_idx = 0
    for off in range(0, VOCAB, BLOCK_V):
        offs = off + tl.arange(0, BLOCK_V)
        score = tl.load(row_ptr + offs, mask=offs < VOCAB, other=-1.0)
        if USE_NOISE:
            score = score / tl.load(noise_ptr + offs, mask=offs < VOCAB, other=1.0)
        block_best = tl.max(score, axis=0)
        block_idx = tl.argmax(score, axis=0, tie_break_left=True)
        better = block_best > best
        best_idx = tl.where(better, off + block_idx, best_idx)
        best = tl.where(better, block_best, best)
    return best_idx


@triton.jit
def _load_q(q_index_ptr, q_token_ids_ptr, q_probs_ptr, Q_TOP_K: tl.constexpr, BLOCK_K: tl.constexpr):
    """Sparse q of one node: ids [BLOCK_K] (-1 pad) and weights [BLOCK_K] (0 pad)."""
    k_idx = tl.arange(0, BLOCK_K)
    q_row = tl.load(q_index_ptr)
    q_mask = (k_idx < Q_TOP_K) & ((k_idx * 0 + q_row) >= 0)
    q_ids = tl.load(q_token_ids_ptr + q_row * Q_TOP_K + k_idx, mask=q_mask, other=-1)
    q_w = tl.load(q_probs_ptr + q_row * Q_TOP_K + k_idx, mask=q_mask, other=0.0)
    return q_ids, tl.where(q_ids >= 0, q_w, 0.0)


@triton.jit
def _verify_tree_kernel(
    accepted_ptr,  # [batch, MAX_NODES - 1] int64, mutable, prefilled with -1
    num_accepted_ptr,  # [batch] int64, mutable
    final_token_ptr,  # [batch] int64, mutable; recovered or bonus token
    residual_ptr,  # [batch, VOCAB] float32, mutable scratch
    token_ids_ptr,  # [total_nodes] int64
    parents_ptr,  # [total_nodes] int64; local, -1 at roots
    cu_num_draft_tokens_ptr,  # [batch + 1] int64
    sampling_ptr,  # [batch] int64; DraftSampling
    is_greedy_ptr,  # [batch] bool (uint8)
    q_index_ptr,  # [total_nodes] int64; row of q_token_ids / q_probs, or -1
    q_token_ids_ptr,  # [num_expanded, Q_TOP_K] int64; -1 pad
    q_probs_ptr,  # [num_expanded, Q_TOP_K] float32
    target_probs_ptr,  # [total_nodes, VOCAB] float32
    uniforms_ptr,  # [total_nodes] float32
    exponentials_ptr,  # [batch, VOCAB] float32
    VOCAB,
    MAX_NODES: tl.constexpr,
    Q_TOP_K: tl.constexpr,
    DETERMINISTIC: tl.constexpr,
    WITHOUT_REPLACEMENT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    b = tl.program_id(0)
    start = tl.load(cu_num_draft_tokens_ptr + b)
    n = (tl.load(cu_num_draft_tokens_ptr + b + 1) - start).to(tl.int32)
    greedy = tl.load(is_greedy_ptr + b) != 0
    mode = tl.load(sampling_ptr + b).to(tl.int32)
    idx = tl.arange(0, BLOCK_N)
    parents = tl.load(parents_ptr + start + idx, mask=idx < n, other=-2).to(tl.int32)
    tokens = tl.load(token_ids_ptr + start + idx, mask=idx < n, other=0)
    residual_row = residual_ptr + b.to(tl.int64) * VOCAB

    node = 0
    cursor = 0
    num_accepted = 0
    touched = 0  # 1 once the residual row holds r for this node (else r = p's row)
    p_row = target_probs_ptr + start * VOCAB
    target_argmax = _row_argmax(p_row, exponentials_ptr, VOCAB, False, BLOCK_V)
    mass = _row_sum(p_row, VOCAB, BLOCK_V)
    q_ids, q_w = _load_q(q_index_ptr + start, q_token_ids_ptr, q_probs_ptr, Q_TOP_K, BLOCK_K)
    walking = n > 1
    while walking:
        child = tl.min(tl.where((parents == node) & (idx > cursor), idx, BLOCK_N), axis=0)
        walking = child < n
        if walking:
            x = tl.sum(tl.where(idx == child, tokens, 0), axis=0)
            if touched != 0:
                r_x = tl.load(residual_row + x)
            else:
                r_x = tl.load(p_row + x)
            p_x = tl.where(mass > 0, r_x / tl.where(mass > 0, mass, 1.0), 0.0)
            q_mass = tl.sum(q_w, axis=0)
            q_x = tl.sum(tl.where(q_ids == x, q_w, 0.0), axis=0)
            q_x = tl.where(q_mass > 0, q_x / tl.where(q_mass > 0, q_mass, 1.0), 0.0)
            u = tl.load(uniforms_ptr + start + child)
            if greedy:
                accept = x == target_argmax
            elif mode == DETERMINISTIC:
                accept = u < p_x
            else:
                accept = (q_x > 0) & (u * q_x < p_x)
            cursor = child
            if accept:
                tl.store(accepted_ptr + b * (MAX_NODES - 1) + num_accepted, child.to(tl.int64))
                num_accepted += 1
                node = child
                touched = 0
                p_row = target_probs_ptr + (start + child) * VOCAB
                if greedy:
                    target_argmax = _row_argmax(p_row, exponentials_ptr, VOCAB, False, BLOCK_V)
                else:
                    mass = _row_sum(p_row, VOCAB, BLOCK_V)
                q_ids, q_w = _load_q(
                    q_index_ptr + start + child, q_token_ids_ptr, q_probs_ptr, Q_TOP_K, BLOCK_K
                )
            elif not greedy:
                if mode == DETERMINISTIC:
                    if touched == 0:
                        _copy_row(p_row, residual_row, VOCAB, BLOCK_V)
                    tl.debug_barrier()
                    mass = mass - r_x
                    tl.store(residual_row + x, 0.0)
                else:
                    q_norm = tl.where(q_mass > 0, q_w / tl.where(q_mass > 0, q_mass, 1.0), 0.0)
                    new_mass = 0.0
                    for off in range(0, VOCAB, BLOCK_V):
                        offs = off + tl.arange(0, BLOCK_V)
                        if touched != 0:
                            r = tl.load(residual_row + offs, mask=offs < VOCAB, other=0.0)
                        else:
                            r = tl.load(p_row + offs, mask=offs < VOCAB, other=0.0)
                        hit = q_ids[None, :] == offs[:, None]  # [BLOCK_V, BLOCK_K]
                        q_dense = tl.sum(tl.where(hit, q_norm[None, :], 0.0), axis=1)
                        r = tl.maximum(r / tl.where(mass > 0, mass, 1.0) - q_dense, 0.0)
                        tl.store(residual_row + offs, r, mask=offs < VOCAB)
                        new_mass += tl.sum(r, axis=0)
                    mass = new_mass
                    if mode == WITHOUT_REPLACEMENT:
                        q_w = tl.where(q_ids == x, 0.0, q_w)
                touched = 1
                tl.debug_barrier()

    if greedy:
        final = target_argmax
    elif (touched != 0) & (mass > 0):
        final = _row_argmax(residual_row, exponentials_ptr + b.to(tl.int64) * VOCAB, VOCAB, True, BLOCK_V)
    else:
        final = _row_argmax(p_row, exponentials_ptr + b.to(tl.int64) * VOCAB, VOCAB, True, BLOCK_V)
    tl.store(num_accepted_ptr + b, num_accepted.to(tl.int64))
    tl.store(final_token_ptr + b, final.to(tl.int64))


@triton.jit
def _copy_row(src_ptr, dst_ptr, VOCAB, BLOCK_V: tl.constexpr):
    for off in range(0, VOCAB, BLOCK_V):
        offs = off + tl.arange(0, BLOCK_V)
        tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=offs < VOCAB), mask=offs < VOCAB)


def verify_triton(
    trees: PackedTrees, target_probs: torch.Tensor, is_greedy: torch.Tensor, randoms: VerifyRandoms
) -> VerifyOutput:
    """Same contract as `verification.verify_reference`."""
    device, n = target_probs.device, trees.max_num_nodes
    batch, vocab = trees.batch_size, target_probs.shape[1]
    q_top_k = trees.q_token_ids.shape[1]
    accepted = torch.full((batch, max(n - 1, 0)), -1, dtype=torch.int64, device=device)
    num_accepted = torch.empty(batch, dtype=torch.int64, device=device)
    final = torch.empty(batch, dtype=torch.int64, device=device)
    residual = torch.empty(batch, vocab, dtype=torch.float32, device=device)
    exponentials = randoms.exponentials.expand(batch, vocab).contiguous()
    q_token_ids, q_probs = trees.q_token_ids, trees.q_probs
    if q_token_ids.shape[0] == 0:  # keep the pointers valid; q_index is all -1
        q_token_ids = torch.full((1, max(q_top_k, 1)), -1, dtype=torch.int64, device=device)
        q_probs = torch.zeros(1, max(q_top_k, 1), dtype=torch.float32, device=device)
        q_top_k = q_token_ids.shape[1]
    _verify_tree_kernel[(batch,)](
        accepted,
        num_accepted,
        final,
        residual,
        trees.token_ids.contiguous(),
        trees.parents.contiguous(),
        trees.cu_num_draft_tokens.contiguous(),
        trees.sampling.contiguous(),
        is_greedy.to(torch.uint8).contiguous(),
        trees.q_index.contiguous(),
        q_token_ids.contiguous(),
        q_probs.float().contiguous(),
        target_probs.float().contiguous(),
        randoms.uniforms.float().contiguous(),
        exponentials.float(),
        vocab,
        MAX_NODES=n,
        Q_TOP_K=q_top_k,
        DETERMINISTIC=int(DraftSampling.DETERMINISTIC),
        WITHOUT_REPLACEMENT=int(DraftSampling.WITHOUT_REPLACEMENT),
        BLOCK_N=next_power_of_2(n),
        BLOCK_K=next_power_of_2(q_top_k),
        BLOCK_V=min(next_power_of_2(vocab), 1024),
    )
    starts = trees.cu_num_draft_tokens[:-1]
    local = torch.arange(n, device=device)
    flat = (starts[:, None] + local).clamp(max=trees.token_ids.numel() - 1)
    return assemble_verify_output(trees.token_ids[flat], accepted, num_accepted, final)
