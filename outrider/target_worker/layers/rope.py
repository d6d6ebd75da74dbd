"""Rotary position embedding: cos/sin tables built once, gathered once per forward.

HF checkpoints describe RoPE either the old way (`rope_theta` + `rope_scaling`) or the
transformers-5 way (`rope_parameters` holding both); `rope_parameters_of` reads either.
Each supported `rope_type` is one inverse-frequency function; an unknown type is refused at
load rather than silently treated as the default (which would give wrong logits past short
contexts).

HF rotates dimension pairs (i, i + D/2) ("rotate_half"). The architecture file permutes the
q and k projection rows of every head at load (`interleave_rotary_rows`) so those pairs sit
side by side, (2i, 2i + 1); attention scores are unchanged because q and k get the same
permutation (the K cache simply holds the permuted layout). RoPE is then one complex
multiply by a [max_positions, D/2] table, for queries and keys together.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch


def rope_parameters_of(hf_config: dict[str, Any]) -> dict[str, Any]:
    params = dict(hf_config.get("rope_parameters") or hf_config.get("rope_scaling") or {})
    params.setdefault("rope_theta", hf_config.get("rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    return params


def _default(params: dict[str, Any], dim: int) -> tuple[torch.Tensor, float]:
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
    return 1.0 / (params["rope_theta"] ** exponents), 1.0


def _linear(params: dict[str, Any], dim: int) -> tuple[torch.Tensor, float]:
    inv_freq, scale = _default(params, dim)
    return inv_freq / params["factor"], scale


def _llama3(params: dict[str, Any], dim: int) -> tuple[torch.Tensor, float]:
    """Llama 3.1: long wavelengths divided by `factor`, a smooth blend in between."""
    inv_freq, scale = _default(params, dim)
    factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
    old_len = params["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
    return torch.where(is_medium, blended, scaled), scale


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn(params: dict[str, Any], dim: int) -> tuple[torch.Tensor, float]:
    """YaRN (arXiv 2309.00071) as HF computes it: a linear ramp between extrapolated
    (original) and interpolated (/ factor) frequencies over the dims whose wavelength falls
    between `beta_fast` and `beta_slow` rotations of the original context; cos/sin scaled by
    `attention_factor` (default mscale(factor, mscale) / mscale(factor, mscale_all_dim))."""
    inv_extra, _ = _default(params, dim)
    factor, old_len, base = params["factor"], params["original_max_position_embeddings"], params["rope_theta"]
    scale = params.get("attention_factor")
    if scale is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            scale = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            scale = _yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(params.get("beta_fast") or 32), correction_dim(params.get("beta_slow") or 1)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    high = high + 0.001 if low == high else high
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolate = 1 - ramp  # 1 = keep the original frequency
    return inv_extra / factor * (1 - extrapolate) + inv_extra * extrapolate, float(scale)


INV_FREQ: dict[str, Callable[[dict[str, Any], int], tuple[torch.Tensor, float]]] = {
    "default": _default,
    "linear": _linear,
    "llama3": _llama3,
    "yarn": _yarn,
}


def interleave_rotary_rows(num_heads: int, head_dim: int) -> torch.Tensor:
    """Row order taking each head's (i, i + D/2) pairs to (2i, 2i + 1): [num_heads * D] int64."""
    half = head_dim // 2
    within = torch.stack([torch.arange(half), torch.arange(half) + half], dim=1).reshape(-1)  # [D]
    return (torch.arange(num_heads)[:, None] * head_dim + within).reshape(-1)


class RotaryEmbedding:
    def __init__(
        self,
        head_dim: int,
        params: dict[str, Any],
        max_positions: int,
        device: torch.device | str = "cpu",
    ):
        rope_type = params["rope_type"]
        if rope_type not in INV_FREQ:
            raise ValueError(f"unsupported rope_type {rope_type!r}; supported: {sorted(INV_FREQ)}")
        inv_freq, attention_scale = INV_FREQ[rope_type](params, head_dim)
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq  # [P, D/2]
        # cos + i sin, computed like HF's tables (cos/sin of fp32 angles, times the scale).
        table = torch.complex(freqs.cos() * attention_scale, freqs.sin() * attention_scale)
        self.table = table.to(device)  # [P, D/2] complex64
        self.max_positions = max_positions

    def lookup(self, positions: torch.Tensor) -> torch.Tensor:
        """[T] positions -> [T, 1, D/2] complex rotations, broadcast over heads; once per forward."""
        return self.table[positions].unsqueeze(1)

    @staticmethod
    def apply(x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
        """x [T, H, D] in interleaved layout -> rotated [T, H, D] (a new tensor)."""
        t, h, d = x.shape
        if x.dtype != torch.float32:
            return RotaryEmbedding.apply(x.float(), rotation).to(x.dtype)
        rotated = torch.view_as_complex(x.reshape(t, h, d // 2, 2)) * rotation
        return torch.view_as_real(rotated).view(t, h, d)
