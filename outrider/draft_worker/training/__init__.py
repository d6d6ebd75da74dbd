"""Training draft heads against a target: one entry point, one registry of methods.

    outrider train-draft --method eagle3 --target DIR --out DIR [--steps N --resume]
    metrics = train_draft(TrainArgs(method="eagle3", target_dir=..., out_dir=...))

Every method trains on the same self-distillation data (`data.DistillData`: the target's
own continuations of training-corpus prompts, with the target features captured by the
runner), and differs only in its trainer:

    @register_trainer("eagle3", layers=eagle3_layer_ids)
    def train_eagle3(args: TrainArgs, data: DistillData) -> dict: ...   # writes args.out_dir

A trainer writes the final checkpoint (the method's published key layout + config.json) to
`args.out_dir` and returns its metrics. `layers` says which target features it needs
(FeatureSpec convention: layer id L = the final hidden state after the final norm); the
default is the final hidden state only. Trainer modules are imported lazily, by method
name, so a CLI `--help` never imports torch and a method whose module is missing fails
with a message naming it.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from outrider.draft_worker.training.data import DistillData


@dataclass
class TrainArgs:
    method: str  # a registered trainer: eagle3, peagle, medusa, mtp, draft_model
    target_dir: str  # the target checkpoint folder (HF layout, with its tokenizer)
    out_dir: str  # where the head checkpoint goes (and the resumable training state)
    steps: int = 600
    batch_size: int = 8  # sequences per step
    lr: float = 3e-3
    seed: int = 0
    resume: bool = False  # continue from the training state saved in out_dir, if any
    device: str = "cpu"
    method_options: dict[str, Any] = field(default_factory=dict)  # the trainer's own knobs
    # Self-distillation data (shared by every method; cached on disk by these values).
    num_sequences: int = 256  # target continuations generated
    prompt_tokens: int = 64  # corpus prompt length
    new_tokens: int = 128  # tokens the target generates after each prompt
    data_temperatures: tuple[float, ...] = (0.0, 1.0)  # cycled over the sequences
    data_cache_dir: str | None = None  # default: $OUTRIDER_HOME/distill
    progress: bool = True
    progress_line: int = 0  # the bar's terminal line (tqdm position), when trainers run side by side
    checkpoint_every: int = 100  # steps between resumable checkpoints
    stop_after: int | None = None  # run at most this many steps now, save, return (resume later)


TrainerFn = Callable[["TrainArgs", "DistillData"], dict]
LayersFn = Callable[[int], tuple[int, ...]]  # target num_hidden_layers -> feature layer ids


@dataclass(frozen=True)
class Trainer:
    method: str
    fn: TrainerFn
    layers: LayersFn


_TRAINERS: dict[str, Trainer] = {}

# Method -> module whose import registers its trainer; loaded when the method is asked for.
_BUILTIN_MODULES = {
    "eagle3": "outrider.draft_worker.training.eagle3",
    "peagle": "outrider.draft_worker.training.peagle",
    "draft_model": "outrider.draft_worker.training.draft_model",
    "medusa": "outrider.draft_worker.training.medusa",
    "mtp": "outrider.draft_worker.training.mtp",
}


def final_hidden_only(num_layers: int) -> tuple[int, ...]:
    return (num_layers,)


def register_trainer(
    method: str, *, layers: LayersFn = final_hidden_only
) -> Callable[[TrainerFn], TrainerFn]:
    """Function decorator: `fn(args, data) -> metrics` trains `method`'s head."""

    def register(fn: TrainerFn) -> TrainerFn:
        if method in _TRAINERS:
            raise ValueError(f"a trainer for {method!r} is already registered ({_TRAINERS[method].fn})")
        _TRAINERS[method] = Trainer(method, fn, layers)
        return fn

    return register


class TrainerUnavailableError(ValueError):
    """The method has no trainer, or its module is not installed."""


def get_trainer(method: str) -> Trainer:
    if method not in _TRAINERS:
        module = _BUILTIN_MODULES.get(method)
        if module is None:
            raise TrainerUnavailableError(
                f"no trainer for method {method!r}; known: {', '.join(known_trainers()) or 'none'}"
            )
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as error:
            if error.name != module:
                raise  # the module exists but one of its own imports is missing: a real error
            raise TrainerUnavailableError(
                f"no trainer for method {method!r}: its module {module} is not present in this checkout"
            ) from error
        if method not in _TRAINERS:
            raise TrainerUnavailableError(f"{module} was imported but registered no trainer for {method!r}")
    return _TRAINERS[method]


def known_trainers() -> list[str]:
    """Methods whose trainer can be loaded here: built-in modules present in this checkout (found
    without importing them, so listing costs no torch import) plus any registered elsewhere."""
    present = {m for m, module in _BUILTIN_MODULES.items() if importlib.util.find_spec(module) is not None}
    return sorted(present | set(_TRAINERS))


def train_draft(args: TrainArgs) -> dict:
    """Build (or load the cached) self-distillation data and train `args.method`'s head."""
    from outrider.draft_worker.training.data import load_distill_data

    trainer = get_trainer(args.method)
    data = load_distill_data(args, trainer.layers)
    return trainer.fn(args, data)


__all__ = [
    "TrainArgs",
    "Trainer",
    "TrainerUnavailableError",
    "final_hidden_only",
    "get_trainer",
    "known_trainers",
    "register_trainer",
    "train_draft",
]
