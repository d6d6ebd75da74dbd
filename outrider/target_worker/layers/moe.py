"""DeepSeek-V3 mixture of experts: grouped top-k routing and routed + shared experts.

Routing (the published "noaux_tc" scheme, arXiv 2412.19437 section 2.1.2), per token:

    s = sigmoid(x @ W_gate^T)                          [E] affinities, fp32
    c = s + e_score_correction_bias                    used to *choose* experts only
    group score = sum of the 2 best c in each of n_group groups
    keep the topk_group best groups, then the top_k experts by c inside them
    weights = s of the chosen experts (/ their sum if norm_topk_prob) * routed_scaling_factor

Experts are SwiGLU MLPs (`gate_up`, `down`); the shared experts are one dense SwiGLU of
width moe_intermediate_size x n_shared_experts that every token goes through.

Tensor parallelism: routed experts are *distributed* across the ranks (rank r owns experts
[r E/N, (r+1) E/N), each whole), while the shared expert and the dense MLPs are split along
their intermediate dimension. Tokens are replicated across the group (attention is
head-parallel), so each rank computes its own experts' share for the tokens routed to them
and the usual single all-reduce per block half sums the ranks' partials: no all-to-all.
Why whole experts rather than 1/N of every expert: each expert keeps its full-width GEMM
(moe_intermediate_size 2048 / 16 ranks would be 128-column slivers), the 128 x 128 FP8
blocks are never cut, and each rank reads only its experts' weights (1/N of the load).
The price is imbalance when routing is skewed (the bias-corrected router keeps it small).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from outrider.target_worker.layers.linear import Linear, read_column, read_row
from outrider.target_worker.loader import CheckpointReader
from outrider.target_worker.parallel.group import TPGroup


@dataclass(frozen=True)
class Routing:
    num_experts: int
    top_k: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float


def route(
    x: torch.Tensor,  # [T, H] normalised hidden states
    gate_t: torch.Tensor,  # [H, E] fp32
    bias: torch.Tensor,  # [E] fp32 e_score_correction_bias
    r: Routing,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(expert ids [T, top_k] int64, weights [T, top_k] fp32)."""
    scores = torch.mm(x.float(), gate_t).sigmoid()  # [T, E]
    choice = scores + bias
    grouped = choice.view(-1, r.n_group, r.num_experts // r.n_group)
    group_scores = grouped.topk(2, dim=-1).values.sum(-1)  # [T, n_group]
    best_groups = group_scores.topk(r.topk_group, dim=-1, sorted=False).indices
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best_groups, True)
    choice = grouped.masked_fill(~keep[:, :, None], float("-inf")).view(-1, r.num_experts)
    ids = choice.topk(r.top_k, dim=-1, sorted=False).indices  # [T, top_k]
    weights = scores.gather(1, ids)
    if r.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return ids, weights * r.routed_scaling_factor


class SwiGLU:
    """gate|up column-parallel (rows [i0, i1) of each), down row-parallel: a partial sum under TP."""

    def __init__(self, reader: CheckpointReader, prefix: str, i0: int, i1: int, dtype, device):
        parts = [(prefix + "gate_proj.weight", i0, i1), (prefix + "up_proj.weight", i0, i1)]
        self.gate_up = Linear(read_column(reader, parts, dtype, device))
        self.down = Linear(read_row(reader, prefix + "down_proj.weight", i0, i1, dtype, device))
        self.width = i1 - i0

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        gate, up = self.gate_up(x).split(self.width, dim=1)
        return self.down(F.silu(gate).mul_(up), residual)


class MoE:
    def __init__(
        self,
        reader: CheckpointReader,
        prefix: str,  # "model.layers.{i}.mlp."
        routing: Routing,
        moe_intermediate_size: int,
        n_shared_experts: int,
        tp: TPGroup,
        dtype,
        device,
    ):
        self.routing, self.tp = routing, tp
        self.e0, self.e1 = tp.even_range(routing.num_experts, "n_routed_experts")
        self.gate_t = reader.read(prefix + "gate.weight", torch.float32).t().contiguous().to(device)
        self.bias = reader.read(prefix + "gate.e_score_correction_bias", torch.float32).to(device)
        full = moe_intermediate_size
        self.experts = [
            SwiGLU(reader, f"{prefix}experts.{e}.", 0, full, dtype, device) for e in range(self.e0, self.e1)
        ]
        s0, s1 = tp.even_range(full * n_shared_experts, "moe_intermediate_size x n_shared_experts")
        self.shared = SwiGLU(reader, prefix + "shared_experts.", s0, s1, dtype, device) if s1 > s0 else None

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        """[T, H] normalised input -> this rank's partial sum [T, H] (+ residual), to all-reduce."""
        ids, weights = route(x, self.gate_t, self.bias, self.routing)
        out = self.shared(x, residual) if self.shared is not None else x.new_zeros(x.shape)
        if residual is not None and self.shared is None:
            out += residual
        local = (ids >= self.e0) & (ids < self.e1)
        token_of, slot_of = local.nonzero(as_tuple=True)
        if token_of.numel() == 0:
            return out
        expert_of = ids[token_of, slot_of] - self.e0
        order = expert_of.argsort(stable=True)
        token_of, slot_of = token_of[order], slot_of[order]
        counts = torch.bincount(expert_of[order], minlength=len(self.experts)).tolist()
        start = 0
        for expert, count in zip(self.experts, counts, strict=True):
            if count:
                tokens = token_of[start : start + count]
                y = expert(x[tokens]) * weights[tokens, slot_of[start : start + count], None].to(x.dtype)
                out.index_add_(0, tokens, y)
            start += count
        return out
