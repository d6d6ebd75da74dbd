"""Training loops for the demo family: the target on the corpus, the draft LM by distillation.

Both are ordinary `transformers` Llama models, so the saved folders are ordinary Hugging Face
checkpoints. `transformers` modelling code is used here, at build time only; serving runs
Outrider's own runner.

Training uses bf16 autocast (fp32 master weights) on CPUs with native bf16 matmuls, where it
trained ~1.5-2x faster than fp32 in a side-by-side run, and fp32 elsewhere (emulated bf16 was 15x
slower than fp32 on an AVX2 CPU: `cpu_bf16_autocast`). The held-out loss is measured in fp32.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm
from transformers import LlamaConfig, LlamaForCausalLM

from outrider.demo.precision import cpu_bf16_autocast
from outrider.demo.recipe import ModelRecipe, TrainRecipe


def llama_config(recipe: ModelRecipe, vocab_size: int, eos_token_id: int) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=recipe.hidden_size,
        num_hidden_layers=recipe.num_layers,
        num_attention_heads=recipe.num_heads,
        num_key_value_heads=recipe.num_kv_heads,
        intermediate_size=recipe.intermediate_size,
        max_position_embeddings=recipe.context,
        rope_theta=recipe.rope_theta,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=eos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=eos_token_id,
        torch_dtype="float32",
    )


def new_model(recipe: ModelRecipe, vocab_size: int, eos_token_id: int, seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(llama_config(recipe, vocab_size, eos_token_id))


def num_parameters(model: torch.nn.Module) -> int:
    # Tied embedding and head are one tensor: count it once.
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


@dataclass(frozen=True)
class TrainStats:
    steps: int
    tokens_seen: int
    final_train_loss: float  # mean of the last 10 steps
    seconds: float


def _lr_at(step: int, recipe: TrainRecipe) -> float:
    if step < recipe.warmup_steps:
        return recipe.lr * (step + 1) / recipe.warmup_steps
    progress = (step - recipe.warmup_steps) / max(1, recipe.steps - recipe.warmup_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return recipe.lr * (recipe.min_lr_ratio + (1 - recipe.min_lr_ratio) * cosine)


def _optimizer(model: torch.nn.Module, recipe: TrainRecipe) -> torch.optim.AdamW:
    params = list({id(p): p for p in model.parameters()}.values())
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]  # norms: decaying them only hurts
    groups = [
        {"params": decay, "weight_decay": recipe.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=recipe.lr, betas=(0.9, 0.95))


def train_lm(
    model: LlamaForCausalLM,
    stream: np.ndarray,
    recipe: TrainRecipe,
    *,
    context: int,
    seed: int,
    desc: str,
    teacher: LlamaForCausalLM | None = None,
    progress: bool = True,
) -> TrainStats:
    """Train on random windows of `stream`.

    Without a teacher the loss is next-token cross-entropy; with one it is KL(teacher ||
    model) over the full next-token distribution (distillation: the draft learns to agree
    with the target, which is what acceptance rewards).
    """
    generator = torch.Generator().manual_seed(seed)
    data = torch.from_numpy(stream.astype(np.int64))
    optimizer = _optimizer(model, recipe)
    model.train()
    if teacher is not None:
        teacher.eval()
    recent: list[float] = []
    started = time.monotonic()
    # Redraw often on a terminal; in logs (CI, Ray) a line every 15 s is enough.
    interval = 0.5 if sys.stderr.isatty() else 15.0
    bar = tqdm(
        range(recipe.steps),
        desc=desc,
        disable=not progress,
        unit="step",
        mininterval=interval,
        dynamic_ncols=True,
    )
    for step in bar:
        starts = torch.randint(0, len(data) - context - 1, (recipe.batch_size,), generator=generator)
        windows = torch.stack([data[s : s + context + 1] for s in starts.tolist()])
        inputs, labels = windows[:, :-1], windows[:, 1:]
        for group in optimizer.param_groups:
            group["lr"] = _lr_at(step, recipe)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cpu_bf16_autocast()):
            logits = model(input_ids=inputs).logits.float()
            if teacher is None:
                loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
            else:
                with torch.no_grad():
                    target_logp = F.log_softmax(teacher(input_ids=inputs).logits.float(), dim=-1)
                draft_logp = F.log_softmax(logits, dim=-1)
                loss = F.kl_div(
                    draft_logp.flatten(0, 1),
                    target_logp.flatten(0, 1),
                    log_target=True,
                    reduction="batchmean",
                )
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        recent = (recent + [loss.item()])[-10:]
        bar.set_postfix(
            loss=f"{sum(recent) / len(recent):.3f}", lr=f"{_lr_at(step, recipe):.1e}", refresh=False
        )
    model.eval()
    return TrainStats(
        steps=recipe.steps,
        tokens_seen=recipe.steps * recipe.batch_size * context,
        final_train_loss=sum(recent) / len(recent),
        seconds=time.monotonic() - started,  # (the bar's own clock reads 0 when it is disabled)
    )


def _eval_windows(stream: np.ndarray, context: int, count: int) -> torch.Tensor:
    """`count` windows of context+1 tokens spread evenly over the held-out stream."""
    count = max(1, min(count, (len(stream) - 1) // (context + 1)))
    starts = np.linspace(0, len(stream) - context - 1, count).astype(np.int64)
    return torch.from_numpy(np.stack([stream[s : s + context + 1] for s in starts]).astype(np.int64))


@torch.no_grad()
def held_out_loss(model: LlamaForCausalLM, stream: np.ndarray, context: int, windows: int) -> float:
    """Mean next-token cross-entropy in nats/token, fp32."""
    total, count = 0.0, 0
    for batch in _eval_windows(stream, context, windows).split(8):
        logits = model(input_ids=batch[:, :-1]).logits
        total += F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten(), reduction="sum").item()
        count += batch[:, 1:].numel()
    return total / count


@torch.no_grad()
def greedy_agreement(
    draft: LlamaForCausalLM, target: LlamaForCausalLM, stream: np.ndarray, context: int, windows: int
) -> float:
    """Share of held-out positions where draft and target agree on the argmax token."""
    agree, count = 0, 0
    for batch in _eval_windows(stream, context, windows).split(8):
        inputs = batch[:, :-1]
        agree += (
            (draft(input_ids=inputs).logits.argmax(-1) == target(input_ids=inputs).logits.argmax(-1))
            .sum()
            .item()
        )
        count += inputs.numel()
    return agree / count
