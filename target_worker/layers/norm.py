"""RMSNorm with the rounding of the HF Llama family: normalise in fp32, scale in the model dtype."""

from __future__ import annotations

import torch
import torch.nn.functional as F


class RMSNorm:
    def __init__(self, weight: torch.Tensor, eps: float):
        self.weight = weight  # [D]
        self.eps = eps
        self.shape = (weight.shape[-1],)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., D] -> [..., D]; one fused op in fp32."""
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.shape, self.weight, self.eps)
        # HF multiplies the weight after casting back, so bf16/fp16 round at the same point.
        return self.weight * F.rms_norm(x.float(), self.shape, None, self.eps).to(x.dtype)
