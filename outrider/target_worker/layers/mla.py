"""Multi-head Latent Attention (DeepSeek-V2/V3) over the compressed cache, weights absorbed.

The cache holds, per token and layer, only the normalised latent c_kv [L] (L = kv_lora_rank)
and the shared rotated key k_pe [R] (R = qk_rope_head_dim): (L + R) values instead of
2 x heads x head_dim. Per head h the full key and value would be

    k_h = [W_UK[h] c_kv ; k_pe]        v_h = W_UV[h] c_kv          (kv_b_proj = [W_UK; W_UV] per head)

and instead of expanding them for every cached token, the up-projections are *absorbed*
into the query and the output (what vLLM and SGLang do for decode):

    score(q, j) = (W_UK[h]^T q_nope) . c_kv[j]  +  q_pe . k_pe[j]      q_lat = W_UK[h]^T q_nope  [L]
    out_h       = W_UV[h] (sum_j softmax_j c_kv[j])                      one [L] -> [D_v] per head

so attention is multi-query attention with one shared "head" of width L + R for keys and
L for values, over rows read straight from the cache (`latent_attention`). The sequence's
masks and groups come from `attention.plan_attention`, as for every other architecture.
"""

from __future__ import annotations

import torch

from outrider.target_worker.layers.attention import AttentionPlan


def latent_attention(
    q_lat: torch.Tensor,  # [T, heads, L] queries absorbed into the latent space
    q_pe: torch.Tensor,  # [T, heads, R] rotated rope part of the queries
    c_cache: torch.Tensor,  # [rows, L] this layer's latents, new tokens already written
    pe_cache: torch.Tensor,  # [rows, R] this layer's rotated rope keys
    plan: AttentionPlan,
    scale: float,
) -> torch.Tensor:
    """Returns [T, heads, L]: the attention-weighted latent per head (apply W_UV after).

    One batched call per length class of the plan, as `attention.ragged_attention`."""
    t, heads, latent = q_lat.shape
    out = None
    for group in plan.groups:
        g, n = group.q_index.shape
        c = group.gather(c_cache)  # [G, kv, L]
        pe = group.gather(pe_cache)  # [G, kv, R]
        ql = q_lat[group.q_index].reshape(g, n * heads, latent)
        qp = q_pe[group.q_index].reshape(g, n * heads, -1)
        scores = torch.baddbmm(torch.bmm(qp, pe.transpose(1, 2)), ql, c.transpose(1, 2))  # [G, n*heads, kv]
        scores = scores.view(g, n, heads, -1)
        if group.mask is not None:
            scores.masked_fill_(~group.mask.transpose(1, 2), float("-inf"))  # [G, n, 1, kv]
        elif group.causal:
            causal = torch.ones(n, c.shape[1], dtype=torch.bool, device=c.device).tril()
            scores.masked_fill_(~causal[None, :, None, :], float("-inf"))
        probs = torch.softmax(scores.float() * scale, dim=-1).to(c.dtype)
        o = torch.bmm(probs.view(g, n * heads, -1), c).view(g * n, heads, latent)
        if group.out_rows is None:
            return o
        if out is None:
            out = q_lat.new_empty(t, heads, latent)
        out[group.out_rows] = o[group.out_take]
    return out
