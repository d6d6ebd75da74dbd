"""RMSNorm for the HF Llama family, mostly folded into the matmul that follows it.

    rmsnorm(x) @ W.T  =  (x * rsqrt(mean(x^2) + eps) * g) @ W.T
                      =  rsqrt(sum(x^2) + H eps) * (x @ (W * g * sqrt(H)).T)

so a pre-norm block computes one per-row scale (`rms_scale`, [T, 1]) and multiplies the
matmul *output* by it, with `g * sqrt(H)` folded into the weight at load (`fold_norm`). On
CPU decode this replaces a ~20 us fused norm per block half with a few cheap ops, and leaves
the residual stream untouched (it is also what EAGLE-3 captures). The rounding differs from
HF's by float epsilon, not by any systematic amount. `RMSNorm` remains for per-head q/k norms
and for returning normalised hidden states.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def fold_norm(weight: torch.Tensor, norm_weight: torch.Tensor) -> torch.Tensor:
    """[out, H] linear weight -> the weight that expects `rms_scale`d rows, not normed ones."""
    return weight * (norm_weight * math.sqrt(norm_weight.shape[-1]))


def rms_scale(x: torch.Tensor, eps: float) -> torch.Tensor:
    """[T, H] -> [T, 1] = rsqrt(sum(x^2) + H eps), computed in fp32, in x's dtype."""
    x32 = x.float()
    scale = torch.rsqrt(torch.linalg.vecdot(x32, x32).unsqueeze_(-1).add_(x.shape[-1] * eps))
    return scale if x.dtype == torch.float32 else scale.to(x.dtype)


class RMSNorm:
    def __init__(self, weight: torch.Tensor, eps: float):
        self.weight = weight  # [D] (or [H, D] for per-head weights)
        self.eps = eps
        self.shape = (weight.shape[-1],)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., D] -> [..., D]; one fused op in fp32."""
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.shape, None, self.eps) * self.weight
        # HF multiplies the weight after casting back, so bf16/fp16 round at the same point.
        return self.weight * F.rms_norm(x.float(), self.shape, None, self.eps).to(x.dtype)
