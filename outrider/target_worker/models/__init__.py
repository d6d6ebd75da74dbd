"""Model architectures. Importing this package registers every architecture file."""

from outrider.target_worker.models import deepseek_v3, llama  # noqa: F401  (register the DeepSeek-V3 and Llama families)
from outrider.target_worker.models.registry import (
    CausalLM,
    UnsupportedArchitectureError,
    register_architecture,
    resolve_architecture,
)

__all__ = ["CausalLM", "UnsupportedArchitectureError", "register_architecture", "resolve_architecture"]
