"""Recipes for the demo model family: what `outrider demo build --size S` trains.

A recipe is data. Its hash keys the cache, so changing any number here rebuilds the family
on next use instead of serving stale weights.

Why these sizes (2-core CPU; measured with `outrider demo build`):
- `small` must build in well under an hour because a new user waits for it on first use (about
  35 minutes on a free 2-core AVX2 CPU, fp32: `demo.train`). In a
  fixed compute budget a small model that sees more tokens beats a large one that sees few,
  so the target is ~5M parameters (H=256, 4 layers) at context 256 rather than the 24M/512
  reference, and the draft LM is ~1.4M parameters distilled from the target (a distilled
  draft agrees with its target far more than one trained on the data alone: docs/algorithms.md section 9).
- `tiny` exists for tests: it must build in a few minutes, so it has a 2k vocabulary
  trained on a tenth of the corpus and a two-layer target.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, replace


@dataclass(frozen=True)
class TokenizerRecipe:
    vocab_size: int


@dataclass(frozen=True)
class ModelRecipe:
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    context: int  # max_position_embeddings, and the training window
    rope_theta: float = 10000.0


@dataclass(frozen=True)
class TrainRecipe:
    steps: int
    batch_size: int  # windows of `context` tokens per step
    lr: float
    warmup_steps: int
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    eval_windows: int = 64  # held-out windows of `context` tokens for the reported loss


@dataclass(frozen=True)
class DemoRecipe:
    name: str
    tokenizer: TokenizerRecipe
    target: ModelRecipe
    target_train: TrainRecipe
    draft: ModelRecipe
    draft_train: TrainRecipe  # distillation (KL to the target's next-token distribution)
    # Share of the training files (every k-th by path) used for the tokenizer and training.
    corpus_fraction: float = 1.0
    seed: int = 0

    def with_seed(self, seed: int) -> DemoRecipe:
        return replace(self, seed=seed)

    def to_dict(self) -> dict:
        return asdict(self)

    def digest(self) -> str:
        """12 hex digits over every field, including the recipe format version."""
        payload = json.dumps({"format": RECIPE_FORMAT, **self.to_dict()}, sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()[:12]


# Bump when the build code changes what a recipe produces (corpus rules, training loop).
RECIPE_FORMAT = 2  # 2: fp32 training where bf16 autocast is emulated

RECIPES: dict[str, DemoRecipe] = {
    "tiny": DemoRecipe(
        name="tiny",
        tokenizer=TokenizerRecipe(vocab_size=2048),
        target=ModelRecipe(
            hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=176, context=128
        ),
        target_train=TrainRecipe(steps=150, batch_size=16, lr=3e-3, warmup_steps=15, eval_windows=16),
        draft=ModelRecipe(
            hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=2, intermediate_size=96, context=128
        ),
        draft_train=TrainRecipe(steps=60, batch_size=16, lr=3e-3, warmup_steps=6, eval_windows=16),
        corpus_fraction=0.1,
    ),
    "small": DemoRecipe(
        name="small",
        tokenizer=TokenizerRecipe(vocab_size=8192),
        target=ModelRecipe(
            hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=4, intermediate_size=688, context=256
        ),
        target_train=TrainRecipe(steps=900, batch_size=8, lr=2e-3, warmup_steps=50),
        draft=ModelRecipe(
            hidden_size=128, num_layers=2, num_heads=2, num_kv_heads=2, intermediate_size=344, context=256
        ),
        draft_train=TrainRecipe(steps=400, batch_size=8, lr=3e-3, warmup_steps=30),
    ),
}

DEFAULT_SIZE = "small"
