"""Hugging Face checkpoint folders: `config.json` plus safetensors weights, never pickle.

A folder holds either one `model.safetensors`, or shards listed by
`model.safetensors.index.json` (its `weight_map`), or loose `*.safetensors` files; every
tensor name is mapped to its file once, then read lazily, and only the slice this
tensor-parallel rank owns is read from disk (`safe_open(...).get_slice`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


class CheckpointError(ValueError):
    """A checkpoint folder that cannot be loaded; the message names the file or tensor."""


class MissingTensorError(CheckpointError):
    pass


class CheckpointReader:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        config_file = self.path / "config.json"
        if not config_file.is_file():
            raise CheckpointError(f"{self.path}: no config.json")
        self.config: dict[str, Any] = json.loads(config_file.read_text())
        self._file_of = self._index_tensors()
        self._handles: dict[str, Any] = {}

    def _index_tensors(self) -> dict[str, str]:
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
            for file in sorted(set(weight_map.values())):
                if not (self.path / file).is_file():
                    raise CheckpointError(f"{index} lists shard {file}, which is not in the folder")
            return weight_map
        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            pickled = [p.name for p in self.path.glob("*.bin")] + [p.name for p in self.path.glob("*.pt")]
            hint = f" (found {', '.join(pickled)}: pickle checkpoints are never loaded)" if pickled else ""
            raise CheckpointError(f"{self.path}: no *.safetensors weights{hint}")
        file_of: dict[str, str] = {}
        for file in files:
            with safe_open(file, framework="pt") as f:
                file_of.update(dict.fromkeys(f.keys(), file.name))
        return file_of

    @property
    def checkpoint_dtype(self) -> torch.dtype:
        name = self.config.get("torch_dtype") or self.config.get("dtype") or "float32"
        if name not in DTYPES:
            raise CheckpointError(
                f"{self.path}: unsupported dtype {name!r}; expected one of {sorted(DTYPES)}"
            )
        return DTYPES[name]

    def has(self, name: str) -> bool:
        return name in self._file_of

    def _handle(self, name: str):
        if name not in self._file_of:
            raise MissingTensorError(f"{self.path}: checkpoint has no tensor {name!r}")
        file = self._file_of[name]
        if file not in self._handles:
            self._handles[file] = safe_open(self.path / file, framework="pt")
        return self._handles[file]

    def shape(self, name: str) -> list[int]:
        return list(self._handle(name).get_slice(name).get_shape())

    def read(
        self,
        name: str,
        dtype: torch.dtype,
        dim: int | None = None,
        start: int = 0,
        stop: int | None = None,
    ) -> torch.Tensor:
        """Tensor `name`, or only rows/columns [start, stop) along `dim` (a TP shard)."""
        tensor_slice = self._handle(name).get_slice(name)
        if dim is None:
            tensor = tensor_slice[:]
        else:
            index = [slice(None)] * len(tensor_slice.get_shape())
            index[dim] = slice(start, stop)
            tensor = tensor_slice[tuple(index)]
        return tensor.to(dtype)
