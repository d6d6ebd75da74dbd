"""Trained draft heads for the demo family: one per registered trainer, built after the target.

    heads = ensure_demo_heads(family)            # {method: folder}, each built once and cached
    folder = demo_head_dir(family, "eagle3")     # the head `--demo` resolves to

Layout, beside (not inside) the family's own manifest, so adding or retraining heads never
touches the target's recipe digest or its cache entry:

    <family dir>/heads/<method>-<head digest>/
        manifest.json      the head recipe, training metrics, build time, sha256 of every file
        config.json + model.safetensors (+ tokenizer files, so `--demo` finds a vocabulary)

The digest covers the head recipe, HEADS_FORMAT and the family's recipe digest. A head is
trained into a temporary folder and renamed into place when complete; a cache hit re-hashes
its files against its manifest. Methods come from the trainer registry
(`draft_worker.training.known_trainers`), so a method whose trainer lands later is built the
next time `outrider demo build` runs; `draft_model` is the family's own draft LM.

Build time (issue 8: `small`, target and every head, under ~20 minutes on the 2-core build
machine; `tiny` under ~2 minutes): the shared self-distillation data is generated once, then
the missing heads train side by side, one process of one torch thread per core
(`build_in_lanes`). Measured at one thread on `small`: data 37 s (13 of them loading the
corpus, free when the family was built in the same process), then eagle3 79 s, peagle 94 s,
medusa 88 s and mtp 111 s of training: ~6.9 minutes one after the other, two lanes of ~3.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from outrider.demo.family import MANIFEST, CorruptCacheError, DemoFamily, build_lock, file_sha256

HEADS_DIR = "heads"
HEADS_FORMAT = 1


@dataclass(frozen=True)
class HeadRecipe:
    steps: int
    batch_size: int = 8
    lr: float = 3e-3
    num_sequences: int = 192  # self-distillation continuations (shared by every method)
    prompt_tokens: int = 64
    new_tokens: int = 128
    options: dict = field(default_factory=dict)  # the trainer's method_options

    def digest(self, family_digest: str) -> str:
        payload = json.dumps(
            {"format": HEADS_FORMAT, "family": family_digest, **asdict(self)}, sort_keys=True
        )
        return hashlib.sha256(payload.encode()).hexdigest()[:12]


_TINY_DATA = {"num_sequences": 48, "prompt_tokens": 32, "new_tokens": 64}
HEAD_RECIPES: dict[str, dict[str, HeadRecipe]] = {
    "tiny": {
        "eagle3": HeadRecipe(steps=60, **_TINY_DATA, options={"ttt_steps": 4, "draft_vocab_size": 1024}),
        "peagle": HeadRecipe(steps=60, **_TINY_DATA, options={"parallel_depth": 5, "draft_vocab_size": 1024}),
    },
    "small": {
        # ~0.55 s per step at one torch thread (ttt_steps 4, 2048 draft ids): ~1.5 minutes a head.
        "eagle3": HeadRecipe(steps=150, options={"ttt_steps": 4, "draft_vocab_size": 2048}),
        "peagle": HeadRecipe(steps=150, options={"parallel_depth": 5, "draft_vocab_size": 2048}),
    },
}
_DEFAULT_RECIPE = {"tiny": HeadRecipe(steps=60, **_TINY_DATA), "small": HeadRecipe(steps=300)}

# Seconds per training step at one torch thread on the 2-core build machine: only used to
# split the heads into lanes of about equal length (`lanes`), never part of a digest.
SECONDS_PER_STEP = {
    "tiny": {"eagle3": 0.08, "peagle": 0.115, "medusa": 0.04, "mtp": 0.03},
    "small": {"eagle3": 0.53, "peagle": 0.63, "medusa": 0.29, "mtp": 0.37},
}


def head_recipe(size: str, method: str) -> HeadRecipe:
    return HEAD_RECIPES.get(size, {}).get(method) or _DEFAULT_RECIPE[size]


def head_methods() -> list[str]:
    """Methods with a trainer here, minus draft_model (the family's draft LM is that head)."""
    from outrider.draft_worker.training import known_trainers

    return [m for m in known_trainers() if m != "draft_model"]


def head_dir(family: DemoFamily, method: str, recipe: HeadRecipe | None = None) -> Path:
    recipe = recipe or head_recipe(family.size, method)
    return family.root / HEADS_DIR / f"{method}-{recipe.digest(family.manifest['recipe_digest'])}"


def verify_head(folder: Path) -> dict:
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError) as e:
        raise CorruptCacheError(f"{folder / MANIFEST} is missing or unreadable ({e})") from e
    present = {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()} - {MANIFEST}
    expected = manifest.get("files") or {}
    if present != set(expected):
        raise CorruptCacheError(f"{folder}: files {sorted(present ^ set(expected))} differ from the manifest")
    for rel, digest in expected.items():
        if file_sha256(folder / rel) != digest:
            raise CorruptCacheError(f"{folder / rel} does not match its sha256 in the manifest")
    return manifest


def demo_head_dir(family: DemoFamily, method: str, *, progress: bool = True, log=print) -> Path:
    """The method's head folder, built first if needed."""
    return ensure_demo_heads(family, [method], progress=progress, log=log)[method]


def ensure_demo_heads(
    family: DemoFamily,
    methods: Iterable[str] | None = None,
    *,
    force: bool = False,
    progress: bool = True,
    log: Callable[[str], None] = print,
    workers: int | None = None,
) -> dict[str, Path]:
    """{method: head folder} for `methods` (default: every trainer), building missing ones.

    Two or more missing heads train side by side in `workers` processes (default: one per CPU,
    at most one per head; `build_in_lanes`), once the data they share is generated here.
    """
    methods = head_methods() if methods is None else list(methods)
    recipes = {m: head_recipe(family.size, m) for m in methods}
    todo = {m: r for m, r in recipes.items() if force or not _usable(head_dir(family, m, r))}
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    workers = min(len(todo), cpus if workers is None else workers)
    if workers > 1:
        threads = max(1, cpus // workers)
        build_in_lanes(family, todo, workers, threads, force=force, progress=progress, log=log)
    else:
        _ensure_heads(family, todo, force=force, progress=progress, log=log)
    return {m: head_dir(family, m, r) for m, r in recipes.items()}


def _usable(folder: Path) -> bool:
    if not folder.exists():
        return False
    try:
        verify_head(folder)
    except CorruptCacheError:
        return False
    return True


def _ensure_heads(
    family: DemoFamily,
    recipes: dict[str, HeadRecipe],
    *,
    force: bool,
    progress: bool,
    log: Callable[[str], None],
    line: int = 0,
) -> None:
    """Build each head unless a usable one is there (one build per head across processes)."""
    for method, recipe in recipes.items():
        folder = head_dir(family, method, recipe)
        with build_lock(folder.with_name(f".{folder.name}.lock")):
            if folder.exists() and not force:
                try:
                    verify_head(folder)
                    continue
                except CorruptCacheError as e:
                    log(f"demo head cache entry is not usable, rebuilding: {e}")
            staging = folder.with_name(f".{folder.name}.building-{os.getpid()}")
            shutil.rmtree(staging, ignore_errors=True)
            build_head(family, method, staging, recipe=recipe, progress=progress, log=log, line=line)
            shutil.rmtree(folder, ignore_errors=True)
            staging.rename(folder)
            verify_head(folder)


# ---- side by side ---------------------------------------------------------------------------


def build_in_lanes(
    family: DemoFamily,
    recipes: dict[str, HeadRecipe],
    workers: int,
    threads: int,
    *,
    force: bool,
    progress: bool,
    log: Callable[[str], None],
) -> None:
    """Train the heads of `recipes` in `workers` spawned processes (lanes) of `threads` torch
    threads each.

    Why: the heads' ops are small (a [1536, 256] activation), so a second torch thread in one
    process buys little, while a second process doubles the work done. On the 2-core build
    machine, with another process busy on it, the four `small` heads took 375 s one after the
    other at one thread and 222 s in two lanes. The self-distillation data is generated first,
    here, so no lane waits on another for it. A custom `log` stays in this process (a lane's
    lines are relayed when the lane ends); `print` runs in the lanes.
    """
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    from outrider.draft_worker.training.data import ensure_distill_data

    with _torch_threads(threads):  # the generation's decode steps are small ops too
        for method, recipe in recipes.items():  # a no-op for methods whose recipe shares the data
            ensure_distill_data(train_args(family, method, recipe, Path(), progress=progress))
    plan = lanes(family.size, recipes, workers)
    log(
        f"training {len(recipes)} heads in {len(plan)} processes of {threads} torch thread(s) each: "
        + " | ".join(", ".join(lane) for lane in plan)
    )
    context = multiprocessing.get_context("spawn")  # fork would copy this process' torch threads
    live = log is print
    with ProcessPoolExecutor(
        len(plan), mp_context=context, initializer=_lane_setup, initargs=(context.RLock(), threads)
    ) as pool:
        runs = [
            pool.submit(_lane, family, lane, line, force, progress, live) for line, lane in enumerate(plan)
        ]
        for run in runs:
            for text in run.result():
                log(text)


def lanes(size: str, recipes: dict[str, HeadRecipe], count: int) -> list[dict[str, HeadRecipe]]:
    """`recipes` in `count` lanes of about equal expected time: longest first, each to the lane
    with the least so far."""
    plan: list[dict[str, HeadRecipe]] = [{} for _ in range(count)]
    load = [0.0] * count

    def seconds(method: str) -> float:
        return recipes[method].steps * SECONDS_PER_STEP.get(size, {}).get(method, 1.0)

    for method in sorted(recipes, key=seconds, reverse=True):
        lane = load.index(min(load))
        plan[lane][method] = recipes[method]
        load[lane] += seconds(method)
    return [lane for lane in plan if lane]


@contextlib.contextmanager
def _torch_threads(count: int) -> Iterator[None]:
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _lane_setup(bar_lock, threads: int) -> None:
    import torch
    from tqdm import tqdm

    tqdm.set_lock(bar_lock)  # the lanes' bars share one terminal
    torch.set_num_threads(threads)


def _lane(
    family: DemoFamily, recipes: dict[str, HeadRecipe], line: int, force: bool, progress: bool, live: bool
) -> list[str]:
    lines: list[str] = []
    log = print if live else lines.append
    _ensure_heads(family, recipes, force=force, progress=progress, log=log, line=line)
    return lines


# ---- one head -------------------------------------------------------------------------------


def train_args(
    family: DemoFamily, method: str, recipe: HeadRecipe, out: Path, *, progress: bool = True, line: int = 0
):
    """`recipe` as the trainer's `TrainArgs` for this family."""
    from outrider.draft_worker.training import TrainArgs

    return TrainArgs(
        method=method,
        target_dir=str(family.target_dir),
        out_dir=str(out),
        steps=recipe.steps,
        batch_size=recipe.batch_size,
        lr=recipe.lr,
        seed=family.manifest.get("seed", 0),
        num_sequences=recipe.num_sequences,
        prompt_tokens=recipe.prompt_tokens,
        new_tokens=recipe.new_tokens,
        data_cache_dir=str(family.root.parent / "distill"),
        method_options=dict(recipe.options),
        progress=progress,
        progress_line=line,
    )


def build_head(
    family: DemoFamily,
    method: str,
    out: Path,
    *,
    recipe: HeadRecipe | None = None,
    progress: bool = True,
    log: Callable[[str], None] = print,
    line: int = 0,
) -> None:
    from outrider.draft_worker.training import train_draft
    from outrider.draft_worker.training.common import drop_train_state

    recipe = recipe or head_recipe(family.size, method)
    started = time.monotonic()
    log(f"training the {method!r} head of the {family.size!r} demo family ({recipe.steps} steps) into {out}")
    metrics = train_draft(train_args(family, method, recipe, out, progress=progress, line=line))
    drop_train_state(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (family.tokenizer_dir / name).is_file():
            shutil.copy2(family.tokenizer_dir / name, out / name)
    manifest = {
        "format": HEADS_FORMAT,
        "method": method,
        "family": family.manifest["recipe_digest"],
        "recipe": asdict(recipe),
        "metrics": {k: v for k, v in metrics.items() if k != "losses"},
        "build_seconds": round(time.monotonic() - started, 1),
    }
    manifest["files"] = {
        p.relative_to(out).as_posix(): file_sha256(p) for p in sorted(out.rglob("*")) if p.is_file()
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    log(
        f"{method} head: loss {metrics['first_loss']:.3f} -> {metrics['final_loss']:.3f} "
        f"in {manifest['build_seconds']:.0f} s"
    )
