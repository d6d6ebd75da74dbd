"""The training loop every head trainer shares: AdamW, cosine LR, progress bar, checkpoints.

    def step_loss(step: int, generator: torch.Generator) -> torch.Tensor: ...   # one batch
    metrics = train_loop(module, args, step_loss, desc="eagle3")
    save_checkpoint(args.out_dir, tensors, config)                             # published layout

Resumable: every `args.checkpoint_every` steps (and at the end) the module's weights, the
AdamW state and the step go to `<out_dir>/train_state/` (safetensors + json; never pickle).
`args.resume` continues from there. A step's batch is drawn from a generator seeded by
(seed, step), so a resumed run sees exactly the batches an uninterrupted one would have.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import load_file, save_file

from outrider.demo.precision import cpu_bf16_autocast

if TYPE_CHECKING:
    from outrider.draft_worker.training import TrainArgs

STATE_DIR = "train_state"


def cosine_lr(step: int, steps: int, lr: float, warmup: int, min_ratio: float = 0.1) -> float:
    """Linear warm-up to `lr`, then cosine decay to lr * min_ratio at `steps`."""
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, steps - warmup))
    return lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def adamw(module: torch.nn.Module, lr: float, weight_decay: float = 0.01) -> torch.optim.AdamW:
    """AdamW over the trainable parameters; no decay on vectors (norms, biases, mask_hidden)."""
    params = [p for p in module.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))


def step_generator(seed: int, step: int) -> torch.Generator:
    """The RNG of one training step: depends on (seed, step) only, so resume replays exactly."""
    return torch.Generator().manual_seed(seed * 1_000_003 + step)


# ---- resumable state ------------------------------------------------------------------------


def save_train_state(
    folder: Path, module: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int, extra: dict
) -> None:
    """Weights, AdamW moments and the step, written to a temporary folder and renamed."""
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    weights = {k: v.detach().cpu().contiguous() for k, v in module.state_dict().items()}
    save_file(weights, str(partial / "weights.safetensors"))
    state = optimizer.state_dict()
    tensors, scalars = {}, {}
    for index, entry in state["state"].items():
        for key, value in entry.items():
            if torch.is_tensor(value):
                tensors[f"{index}.{key}"] = value.detach().cpu().contiguous()
            else:
                scalars[f"{index}.{key}"] = value
    save_file(tensors, str(partial / "optimizer.safetensors"))
    meta = {"step": step, "param_groups": state["param_groups"], "scalars": scalars, **extra}
    (partial / "state.json").write_text(json.dumps(meta, indent=1))
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(partial, folder)


def load_train_state(
    folder: Path, module: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> tuple[int, dict]:
    """Restores module and optimizer in place; returns (step, the saved json)."""
    meta = json.loads((folder / "state.json").read_text())
    module.load_state_dict(load_file(str(folder / "weights.safetensors")))
    tensors = load_file(str(folder / "optimizer.safetensors"))
    state: dict[int, dict] = {}
    for name, value in tensors.items():
        index, key = name.split(".", 1)
        state.setdefault(int(index), {})[key] = value
    for name, value in meta["scalars"].items():
        index, key = name.split(".", 1)
        state.setdefault(int(index), {})[key] = value
    optimizer.load_state_dict({"state": state, "param_groups": meta["param_groups"]})
    return int(meta["step"]), meta


# ---- the loop -------------------------------------------------------------------------------


def train_loop(
    module: torch.nn.Module,
    args: TrainArgs,
    step_loss: Callable[[int, torch.Generator], torch.Tensor],
    *,
    desc: str,
    warmup: int | None = None,
    weight_decay: float = 0.01,
    grad_clip: float = 1.0,
    autocast: bool = True,
) -> dict:
    """Runs steps [start, args.steps) and returns metrics (losses per step, first/final means).

    `step_loss(step, generator)` draws its batch from `generator` and returns the scalar
    loss; bf16 autocast on CPU (fp32 master weights) where it pays (`cpu_bf16_autocast`) unless
    `autocast` is False.
    """
    from tqdm import tqdm

    optimizer = adamw(module, args.lr, weight_decay)
    folder = Path(args.out_dir) / STATE_DIR
    start, history = 0, []
    if args.resume and (folder / "state.json").is_file():
        start, meta = load_train_state(folder, module, optimizer)
        history = meta.get("losses", [])
    warmup = max(1, args.steps // 20) if warmup is None else warmup
    terminal = sys.stderr.isatty()
    interval = 0.5 if terminal else 15.0
    end = args.steps if args.stop_after is None else min(args.steps, start + args.stop_after)
    bar = tqdm(
        range(start, end),
        initial=start,
        total=args.steps,
        desc=desc,
        unit="step",
        disable=not args.progress,
        position=args.progress_line if terminal else None,  # in a log, cursor moves are noise
        mininterval=interval,
        dynamic_ncols=True,
    )
    started = time.monotonic()
    module.train()
    use_autocast = autocast and args.device == "cpu" and cpu_bf16_autocast()
    for step in bar:
        lr = cosine_lr(step, args.steps, args.lr, warmup)
        for group in optimizer.param_groups:
            group["lr"] = lr
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=use_autocast):
            loss = step_loss(step, step_generator(args.seed, step))
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for p in module.parameters() if p.requires_grad], grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        history.append(float(loss.item()))
        recent = history[-10:]
        bar.set_postfix(loss=f"{sum(recent) / len(recent):.3f}", lr=f"{lr:.1e}", refresh=False)
        if (step + 1) % args.checkpoint_every == 0 or step + 1 == end:
            save_train_state(folder, module, optimizer, step + 1, {"losses": history})
    bar.close()
    module.eval()
    head = history[:10] or [float("nan")]
    tail = history[-10:] or [float("nan")]
    return {
        "start_step": start,
        "steps": args.steps,
        "losses": history,
        "first_loss": sum(head) / len(head),
        "final_loss": sum(tail) / len(tail),
        "seconds": round(time.monotonic() - started, 1),
    }


def save_checkpoint(out_dir: str | Path, tensors: dict[str, torch.Tensor], config: dict) -> Path:
    """`model.safetensors` + `config.json` in `out_dir` (each written whole, then renamed)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    weights = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
    save_file(weights, str(out / "model.safetensors.partial"), metadata={"format": "pt"})
    os.replace(out / "model.safetensors.partial", out / "model.safetensors")
    (out / "config.json.partial").write_text(json.dumps(config, indent=2) + "\n")
    os.replace(out / "config.json.partial", out / "config.json")
    return out


def drop_train_state(out_dir: str | Path) -> None:
    """Remove the resumable state once a finished checkpoint no longer needs it."""
    shutil.rmtree(Path(out_dir) / STATE_DIR, ignore_errors=True)
