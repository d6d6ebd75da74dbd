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
masks come from `attention.plan_attention`, as for every other architecture.
"""

from __future__ import annotations

import torch

from outrider.target_worker.layers.attention import SeqAttention


def latent_attention(
    q_lat: torch.Tensor,  # [T, heads, L] queries absorbed into the latent space
    q_pe: torch.Tensor,  # [T, heads, R] rotated rope part of the queries
    c_cache: torch.Tensor,  # [rows, L] this layer's latents, new tokens already written
    pe_cache: torch.Tensor,  # [rows, R] this layer's rotated rope keys
    plan: list[SeqAttention],
    scale: float,
) -> torch.Tensor:
    """Returns [T, heads, L]: the attention-weighted latent per head (apply W_UV after)."""
    t, heads, latent = q_lat.shape
    out = q_lat.new_empty(t, heads, latent)
    for seq in plan:
        n = seq.q_stop - seq.q_start
        c = c_cache[seq.kv_start : seq.kv_stop]  # [kv, L], a view
        pe = pe_cache[seq.kv_start : seq.kv_stop]  # [kv, R]
        ql = q_lat[seq.q_start : seq.q_stop].reshape(n * heads, latent)
        qp = q_pe[seq.q_start : seq.q_stop].reshape(n * heads, -1)
        scores = torch.addmm(torch.mm(qp, pe.t()), ql, c.t()).view(n, heads, -1)  # [n, heads, kv]
        mask = seq.mask
        if mask is None and seq.causal:
            mask = torch.ones(n, c.shape[0], dtype=torch.bool, device=c.device).tril()
        if mask is not None:
            scores.masked_fill_(~mask[:, None, :], float("-inf"))
        probs = torch.softmax(scores.float() * scale, dim=-1).to(c.dtype)
        out[seq.q_start : seq.q_stop] = torch.mm(probs.view(n * heads, -1), c).view(n, heads, latent)
    return out
