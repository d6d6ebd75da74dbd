"""Model architectures. Importing this package registers every architecture file."""

from target_worker.models import llama  # noqa: F401  (registers the Llama family)
from target_worker.models.registry import (
    CausalLM,
    UnsupportedArchitectureError,
    register_architecture,
    resolve_architecture,
)

__all__ = ["CausalLM", "UnsupportedArchitectureError", "register_architecture", "resolve_architecture"]
