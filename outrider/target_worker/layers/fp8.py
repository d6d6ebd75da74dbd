"""FP8 block-scaled checkpoints (DeepSeek-V3's published layout), dequantised at load.

A quantised linear weight W [out, in] is stored as `name` (torch.float8_e4m3fn) beside
`name + "_scale_inv"` (float32, [ceil(out / bo), ceil(in / bi)]), one scale per block of
`quantization_config.weight_block_size = [bo, bi]` (128 x 128 in the released config):

    W[r, c] = W_fp8[r, c] * scale_inv[r // bo, c // bi]

`BlockFP8Reader` wraps a `CheckpointReader` so architecture files read as usual
(`reader.read(name, dtype, dim, start, stop)`, TP shards included): a tensor with a
`_scale_inv` companion comes back dequantised, reading only the blocks its shard touches.
The runner then holds plain bf16/fp32 weights; FP8 matmuls are future work.
"""

from __future__ import annotations

import torch

from outrider.target_worker.loader import CheckpointError, CheckpointReader

SCALE_SUFFIX = "_scale_inv"


def block_size_of(hf_config: dict) -> tuple[int, int] | None:
    """The [bo, bi] block of an fp8 `quantization_config`, or None for an unquantised checkpoint."""
    quant = hf_config.get("quantization_config")
    if not quant:
        return None
    if quant.get("quant_method") != "fp8" or quant.get("fmt", "e4m3") != "e4m3":
        raise CheckpointError(f"unsupported quantization_config {quant!r} (only block-scaled fp8 e4m3)")
    block = quant.get("weight_block_size")
    if not block or len(block) != 2:
        raise CheckpointError(f"quantization_config needs weight_block_size [rows, cols], got {block!r}")
    return int(block[0]), int(block[1])


def dequantize_blocks(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """[out, in] fp8 x [ceil(out/bo), ceil(in/bi)] scales -> [out, in] float32."""
    rows, cols = weight.shape
    scale = scale_inv.float().repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    return weight.float() * scale


def quantize_blocks(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse, for tests and tools: [out, in] -> (fp8 weight, float32 scale_inv per block)."""
    rows, cols = weight.shape
    bo, bi = block
    padded = torch.zeros(-(-rows // bo) * bo, -(-cols // bi) * bi)
    padded[:rows, :cols] = weight.float()
    tiles = padded.view(padded.shape[0] // bo, bo, padded.shape[1] // bi, bi)
    amax = tiles.abs().amax(dim=(1, 3)).clamp_min(1e-12)  # [blocks_out, blocks_in]
    scale_inv = amax / torch.finfo(torch.float8_e4m3fn).max
    quantized = (tiles / scale_inv[:, None, :, None]).view_as(padded)[:rows, :cols]
    return quantized.to(torch.float8_e4m3fn), scale_inv


class BlockFP8Reader:
    """A `CheckpointReader` whose `read` dequantises block-scaled fp8 weights."""

    def __init__(self, reader: CheckpointReader, block: tuple[int, int]):
        self.inner, self.block = reader, block
        self.config, self.path = reader.config, reader.path

    def has(self, name: str) -> bool:
        return self.inner.has(name)

    def shape(self, name: str) -> list[int]:
        return self.inner.shape(name)

    def read(
        self, name: str, dtype: torch.dtype, dim: int | None = None, start: int = 0, stop: int | None = None
    ) -> torch.Tensor:
        if not self.inner.has(name + SCALE_SUFFIX):
            return self.inner.read(name, dtype, dim, start, stop)
        rows, cols = self.inner.shape(name)
        if dim is None:
            dim, start, stop = 0, 0, rows
        stop = (rows, cols)[dim] if stop is None else stop
        b = self.block[dim]
        # Read whole blocks covering [start, stop), dequantise, then crop to the shard.
        lo, hi = start // b * b, min(-(-stop // b) * b, (rows, cols)[dim])
        weight = self.inner.read(name, torch.float8_e4m3fn, dim, lo, hi)
        scale = self.inner.read(name + SCALE_SUFFIX, torch.float32, dim, lo // b, -(-hi // b))
        full = dequantize_blocks(weight, scale, self.block)
        return full.narrow(dim, start - lo, stop - start).to(dtype)


def maybe_fp8(reader: CheckpointReader) -> CheckpointReader | BlockFP8Reader:
    block = block_size_of(reader.config)
    return reader if block is None else BlockFP8Reader(reader, block)
