"""Dense tensors on the wire: dtype name + shape + raw bytes (the `Tensor` message).

Feature tensors (target hidden states for EAGLE-style drafters) are the only bulky payload
of a round, so they travel as one `bytes` field rather than a repeated float: no per-element
encoding, and bfloat16 (which protobuf has no type for) costs two bytes a value. Bytes are in
the host's native order, which is little-endian on every platform we serve from (x86-64,
aarch64); `torch.frombuffer` reads them back without a copy per element.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from outrider.proto import outrider_pb2 as pb
from outrider.proto.errors import InvalidDraftError

# The only dtypes a feature tensor may have; the keys are the names used on the wire.
FEATURE_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
_DTYPE_NAMES = {dtype: name for name, dtype in FEATURE_DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of a feature dtype; ValueError for any other dtype."""
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise ValueError(f"feature dtype {dtype} is not one of {sorted(FEATURE_DTYPES)}") from None


def encode_tensor(values: torch.Tensor) -> pb.Tensor:
    """A CPU copy of `values` as a `Tensor` message (any shape, a FEATURE_DTYPES dtype)."""
    name = dtype_name(values.dtype)
    flat = values.detach().to("cpu").contiguous().reshape(-1)
    # Viewing as bytes sidesteps numpy, which has no bfloat16.
    data = flat.view(torch.uint8).numpy().tobytes()
    return pb.Tensor(dtype=name, shape=list(values.shape), data=data)


def check_tensor_header(dtype: str, shape: list[int], nbytes: int, field: str) -> torch.dtype:
    """Raise InvalidDraftError unless `nbytes` bytes can hold a `dtype` tensor of `shape`."""
    if dtype not in FEATURE_DTYPES:
        raise InvalidDraftError(f"{field}.dtype = {dtype!r} is not one of {sorted(FEATURE_DTYPES)}")
    torch_dtype = FEATURE_DTYPES[dtype]
    for axis, size in enumerate(shape):
        if size < 0:
            raise InvalidDraftError(f"{field}.shape[{axis}] = {size} is negative")
    itemsize = torch.empty((), dtype=torch_dtype).element_size()
    expected = math.prod(shape) * itemsize
    if nbytes != expected:
        raise InvalidDraftError(
            f"{field}.data has {nbytes} bytes, but shape {list(shape)} of {dtype} needs "
            f"{math.prod(shape)} * {itemsize} = {expected}"
        )
    return torch_dtype


def decode_tensor(message: pb.Tensor, field: str = "tensor") -> torch.Tensor:
    """The CPU tensor a `Tensor` message holds; InvalidDraftError if its header lies.

    `field` names the tensor in error messages (e.g. "updates[3].features").
    """
    shape = list(message.shape)
    dtype = check_tensor_header(message.dtype, shape, len(message.data), field)
    if not message.data:
        # frombuffer refuses an empty buffer; a zero-size tensor still keeps its shape.
        return torch.empty(shape, dtype=dtype)
    # bytearray: frombuffer wants a writable buffer, and the message's bytes are immutable.
    return torch.frombuffer(bytearray(message.data), dtype=dtype).reshape(shape)


def repeated_to_tensor(values: Sequence[int] | Sequence[float], dtype: torch.dtype) -> torch.Tensor:
    """A packed repeated field as a 1-D CPU tensor of `dtype`.

    Through numpy, which reads protobuf's repeated containers about 10x faster than
    `torch.tensor(list(...))`: it matters at batch x nodes x top-k values per round.
    """
    numpy_dtype = torch.empty((), dtype=dtype).numpy().dtype
    return torch.from_numpy(np.array(values, dtype=numpy_dtype))


# ---- the drafter's feature projection (FeatureProjection RPC) -------------------------------

DEFAULT_PROJECTION_CHUNK_BYTES = 1 << 20


def projection_sha256(projection: torch.Tensor) -> str:
    """The handshake's fingerprint of a projection: sha256 of its float32 bytes, row-major."""
    import hashlib

    data = projection.detach().to("cpu", torch.float32).contiguous().view(torch.uint8).numpy()
    return hashlib.sha256(data.tobytes()).hexdigest()


def projection_chunks(projection: torch.Tensor, max_chunk_bytes: int = 0) -> list[pb.Tensor]:
    """Row blocks of the float32 [H, W] projection, each at most `max_chunk_bytes` (0 = 1 MiB)."""
    matrix = projection.detach().to("cpu", torch.float32)
    if matrix.dim() != 2 or matrix.shape[0] == 0:
        raise ValueError(f"a feature projection is a non-empty [H, W] matrix, not {tuple(matrix.shape)}")
    row_bytes = matrix.shape[1] * 4
    rows = max(1, (max_chunk_bytes or DEFAULT_PROJECTION_CHUNK_BYTES) // max(row_bytes, 1))
    return [encode_tensor(matrix[start : start + rows]) for start in range(0, matrix.shape[0], rows)]


def join_projection(chunks: Sequence[pb.Tensor], sha256: str) -> torch.Tensor:
    """The projection from its streamed blocks; InvalidDraftError if they do not match `sha256`."""
    blocks = [decode_tensor(chunk, f"projection[{i}]") for i, chunk in enumerate(chunks)]
    if not blocks or any(b.dim() != 2 or b.dtype != torch.float32 for b in blocks):
        raise InvalidDraftError("a feature projection arrives as float32 [rows, W] blocks")
    if len({b.shape[1] for b in blocks}) != 1:
        raise InvalidDraftError("feature projection blocks disagree on their width")
    projection = torch.cat(blocks)
    got = projection_sha256(projection)
    if got != sha256:
        raise InvalidDraftError(
            f"feature projection sha256 {got[:16]}… is not the handshake's {sha256[:16]}…"
        )
    return projection
