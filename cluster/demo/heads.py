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
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from cluster.demo.family import MANIFEST, CorruptCacheError, DemoFamily, _build_lock, _sha256

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
        # ~2.7 s per step at ttt_steps 5 / 4096 ids on this CPU: the budget is ~5 minutes per head.
        "eagle3": HeadRecipe(steps=150, options={"ttt_steps": 4, "draft_vocab_size": 2048}),
        "peagle": HeadRecipe(steps=150, options={"parallel_depth": 5, "draft_vocab_size": 2048}),
    },
}
_DEFAULT_RECIPE = {"tiny": HeadRecipe(steps=60, **_TINY_DATA), "small": HeadRecipe(steps=300)}


def head_recipe(size: str, method: str) -> HeadRecipe:
    return HEAD_RECIPES.get(size, {}).get(method) or _DEFAULT_RECIPE[size]


def head_methods() -> list[str]:
    """Methods with a trainer here, minus draft_model (the family's draft LM is that head)."""
    from draft_worker.training import known_trainers

    return [m for m in known_trainers() if m != "draft_model"]


def head_dir(family: DemoFamily, method: str) -> Path:
    recipe = head_recipe(family.size, method)
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
        if _sha256(folder / rel) != digest:
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
) -> dict[str, Path]:
    """{method: head folder} for `methods` (default: every trainer), building missing ones."""
    out = {}
    for method in head_methods() if methods is None else methods:
        folder = head_dir(family, method)
        with _build_lock(folder.with_name(f".{folder.name}.lock")):
            if folder.exists() and not force:
                try:
                    verify_head(folder)
                    out[method] = folder
                    continue
                except CorruptCacheError as e:
                    log(f"demo head cache entry is not usable, rebuilding: {e}")
            staging = folder.with_name(f".{folder.name}.building-{os.getpid()}")
            shutil.rmtree(staging, ignore_errors=True)
            build_head(family, method, staging, progress=progress, log=log)
            shutil.rmtree(folder, ignore_errors=True)
            staging.rename(folder)
            verify_head(folder)
            out[method] = folder
    return out


def build_head(
    family: DemoFamily, method: str, out: Path, *, progress: bool = True, log: Callable[[str], None] = print
) -> None:
    from draft_worker.training import TrainArgs, train_draft
    from draft_worker.training.common import drop_train_state

    recipe = head_recipe(family.size, method)
    started = time.monotonic()
    log(f"training the {method!r} head of the {family.size!r} demo family ({recipe.steps} steps) into {out}")
    args = TrainArgs(
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
    )
    metrics = train_draft(args)
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
        p.relative_to(out).as_posix(): _sha256(p) for p in sorted(out.rglob("*")) if p.is_file()
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    log(
        f"{method} head: loss {metrics['first_loss']:.3f} -> {metrics['final_loss']:.3f} "
        f"in {manifest['build_seconds']:.0f} s"
    )
