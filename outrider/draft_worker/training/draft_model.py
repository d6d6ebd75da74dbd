"""`draft_model` training: a small independent Llama LM distilled from the target.

    outrider train-draft --method draft_model --target DIR --out DIR --steps 400

The loop is the demo family's own distillation (`demo.train.train_lm` with the target
as teacher: KL(target || draft) over the full next-token distribution), run here on the
self-distillation token stream (the target's continuations of corpus prompts) instead of the
raw corpus. The result is an ordinary Hugging Face Llama folder (safetensors) with the
target's tokenizer files, which `draft_model` serves. Not resumable: `train_lm` has no
optimizer checkpoints (`--resume` is refused rather than silently ignored).

Options: hidden_size (128), num_layers (2), num_heads (2), intermediate_size (344),
context (the target's max_position_embeddings), warmup_steps (steps // 15).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from outrider.draft_worker.training import TrainArgs, register_trainer
from outrider.draft_worker.training.data import DistillData

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


@register_trainer("draft_model")
def train_draft_model(args: TrainArgs, data: DistillData) -> dict:
    # The demo family's training code, reused as-is (imported here: cluster sits above draft_worker).
    from transformers import AutoModelForCausalLM

    from outrider.demo.recipe import ModelRecipe, TrainRecipe
    from outrider.demo.train import new_model, train_lm

    if args.resume:
        raise ValueError(
            "draft_model training is not resumable (the distillation loop keeps no optimizer state)"
        )
    options = args.method_options
    context = int(options.get("context", data.tokens.shape[1]))
    recipe = ModelRecipe(
        hidden_size=int(options.get("hidden_size", 128)),
        num_layers=int(options.get("num_layers", 2)),
        num_heads=int(options.get("num_heads", 2)),
        num_kv_heads=int(options.get("num_heads", 2)),
        intermediate_size=int(options.get("intermediate_size", 344)),
        context=int(data.target_config.get("max_position_embeddings", context)),
    )
    train = TrainRecipe(
        steps=args.steps,
        batch_size=args.batch_size,
        lr=args.lr,
        warmup_steps=int(options.get("warmup_steps", max(1, args.steps // 15))),
    )
    eos = data.target_config.get("eos_token_id") or 0
    eos = eos[0] if isinstance(eos, list) else eos
    teacher = AutoModelForCausalLM.from_pretrained(args.target_dir, dtype=torch.float32)
    draft = new_model(recipe, data.vocab_size, eos, seed=args.seed)
    stream = data.tokens.flatten().numpy()
    stats = train_lm(
        draft,
        stream,
        train,
        context=min(context, recipe.context),
        seed=args.seed,
        desc="draft_model (distilled)",
        teacher=teacher,
        progress=args.progress,
    )
    out = Path(args.out_dir)
    draft.save_pretrained(out, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (Path(args.target_dir) / name).is_file():
            shutil.copy2(Path(args.target_dir) / name, out / name)
    return {
        "start_step": 0,
        "steps": stats.steps,
        "final_loss": stats.final_train_loss,
        "seconds": round(stats.seconds, 1),
    }
