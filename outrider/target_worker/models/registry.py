"""Architecture registry: HF `architectures` / `model_type` names -> the file that builds it.

An architecture file defines a model class with `from_checkpoint(...)` and registers it:

    @register_architecture("LlamaForCausalLM", "llama")
    class LlamaFamilyModel: ...

and the runner never branches on names. Adding DeepSeek-V3 is one more file that registers
"DeepseekV3ForCausalLM" / "deepseek_v3" with its own `kv_spec` (MLA latent rows) and forward.
"""

from __future__ import annotations

from typing import Protocol

import torch

from outrider.target_worker.batch import ForwardBatch, ForwardOutput
from outrider.target_worker.kv_cache import KVSpec
from outrider.target_worker.layers.attention import AttentionPlan
from outrider.target_worker.loader import CheckpointError, CheckpointReader
from outrider.target_worker.parallel.group import TPGroup


class UnsupportedArchitectureError(CheckpointError):
    pass


class CausalLM(Protocol):
    num_layers: int
    hidden_size: int
    vocab_size: int

    @classmethod
    def from_checkpoint(
        cls,
        reader: CheckpointReader,
        tp: TPGroup,
        dtype: torch.dtype,
        device: torch.device | str,
        max_positions: int,
    ) -> CausalLM: ...

    def kv_spec(self) -> KVSpec:
        """The per-token, per-layer cache rows this model writes (sharded for this rank)."""
        ...

    def forward(
        self,
        batch: ForwardBatch,
        plan: AttentionPlan,
        kv_layers: list[tuple[torch.Tensor, ...]],
    ) -> ForwardOutput: ...


_ARCHITECTURES: dict[str, type[CausalLM]] = {}


def register_architecture(*names: str):
    def register(cls: type[CausalLM]) -> type[CausalLM]:
        for name in names:
            _ARCHITECTURES[name] = cls
        return cls

    return register


def resolve_architecture(hf_config: dict) -> type[CausalLM]:
    """The registered model class for a config.json; refuses unknown architectures by name."""
    names = [*(hf_config.get("architectures") or []), hf_config.get("model_type")]
    for name in names:
        if name in _ARCHITECTURES:
            return _ARCHITECTURES[name]
    shown = ", ".join(repr(n) for n in names if n)
    raise UnsupportedArchitectureError(
        f"unsupported architecture {shown or '(config.json names none)'}; "
        f"supported: {', '.join(sorted(_ARCHITECTURES))}"
    )
