"""Which training precision pays on this CPU (the demo family and its heads train on CPU)."""

from __future__ import annotations

import functools

import torch


@functools.cache
def cpu_bf16_autocast() -> bool:
    """Whether bf16 autocast speeds up training on this CPU.

    It does where oneDNN has native bf16 matmuls (AVX-512 BF16, AMX: ~1.5-2x over fp32). Where
    it does not, oneDNN emulates them: on a 2-core AVX2 EPYC a `small` demo target step took
    22 s under bf16 autocast against 1.5 s in fp32. So autocast is used only where it pays.
    """
    return torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
