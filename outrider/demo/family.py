"""Build, cache and verify the demo model family.

A family is one folder:

    $OUTRIDER_HOME/demo/<size>-<recipe digest>/
        manifest.json      recipe, seed, parameter counts, tokens seen, held-out losses,
                           and the sha256 of every other file (written last)
        tokenizer/         tokenizer.json + configs (AutoTokenizer loads it)
        target/            config.json + model.safetensors + tokenizer files
        draft/             the independent draft LM, same layout
        heads/             trained draft heads (eagle3, peagle, ...), each with its own
                           manifest and digest (`draft_worker.training.demo_heads`); not in this manifest

The digest covers the whole recipe including the seed, so a changed recipe is a new entry.
A build writes into a temporary folder and renames it into place only when complete, and a
cache hit re-hashes every file against the manifest: a partial or corrupt entry (killed
build, truncated copy, edited weights) is reported and rebuilt, never loaded.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import platform
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from outrider.demo import corpus as corpus_mod
from outrider.demo.recipe import RECIPE_FORMAT, RECIPES, DemoRecipe

MANIFEST = "manifest.json"


class CorruptCacheError(RuntimeError):
    """A cached demo family does not match its manifest."""


@dataclass(frozen=True)
class DemoFamily:
    root: Path
    manifest: dict

    @property
    def size(self) -> str:
        return self.manifest["size"]

    @property
    def target_dir(self) -> Path:
        return self.root / "target"

    @property
    def draft_dir(self) -> Path:
        return self.root / "draft"

    @property
    def tokenizer_dir(self) -> Path:
        return self.root / "tokenizer"


def outrider_home() -> Path:
    return Path(os.environ.get("OUTRIDER_HOME") or Path.home() / ".cache" / "outrider")


def recipe_for(size: str, seed: int = 0) -> DemoRecipe:
    if size not in RECIPES:
        raise ValueError(f"unknown demo size {size!r}; choose one of {sorted(RECIPES)}")
    return RECIPES[size].with_seed(seed)


def family_dir(recipe: DemoRecipe, home: Path | None = None) -> Path:
    return (home or outrider_home()) / "demo" / f"{recipe.name}-{recipe.digest()}"


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def verify_family(root: Path, recipe: DemoRecipe) -> DemoFamily:
    """Check a cached folder against its manifest; raise CorruptCacheError saying what is wrong."""
    try:
        manifest = json.loads((root / MANIFEST).read_text())
    except (OSError, ValueError) as e:
        raise CorruptCacheError(f"{root / MANIFEST} is missing or unreadable ({e})") from e
    if manifest.get("recipe_digest") != recipe.digest():
        raise CorruptCacheError(f"{root} was built from another recipe ({manifest.get('recipe_digest')})")
    expected = manifest.get("files") or {}
    # heads/ holds the trained draft heads, each under its own manifest (draft_worker.training.demo_heads).
    present = {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()} - {MANIFEST}
    present = {p for p in present if not p.startswith("heads/")}
    if missing := sorted(set(expected) - present):
        raise CorruptCacheError(f"{root} is missing {missing}")
    if extra := sorted(present - set(expected)):
        raise CorruptCacheError(f"{root} has files its manifest does not list: {extra}")
    for rel, digest in expected.items():
        if file_sha256(root / rel) != digest:
            raise CorruptCacheError(f"{root / rel} does not match its sha256 in the manifest")
    return DemoFamily(root, manifest)


@contextlib.contextmanager
def build_lock(path: Path) -> Iterator[None]:
    """One build per cache entry at a time, across processes (tests, Ray workers)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def ensure_demo_family(
    size: str = "small",
    *,
    seed: int = 0,
    home: Path | None = None,
    force: bool = False,
    progress: bool = True,
    log: Callable[[str], None] = print,
) -> DemoFamily:
    """Return the cached family for (size, seed), building it first if absent or corrupt."""
    recipe = recipe_for(size, seed)
    root = family_dir(recipe, home)
    with build_lock(root.with_name(f".{root.name}.lock")):
        if root.exists() and not force:
            try:
                return verify_family(root, recipe)
            except CorruptCacheError as e:
                log(f"demo cache entry is not usable, rebuilding: {e}")
        staging = root.with_name(f".{root.name}.building-{os.getpid()}")
        shutil.rmtree(staging, ignore_errors=True)
        build_family(recipe, staging, progress=progress, log=log)
        shutil.rmtree(root, ignore_errors=True)
        staging.rename(root)
        return verify_family(root, recipe)


def build_family(
    recipe: DemoRecipe, out: Path, *, progress: bool = True, log: Callable[[str], None] = print
) -> None:
    """Train tokenizer, target and draft from scratch into `out` and write its manifest."""
    # Imported here so that a cache hit (the common case) never pays for torch/transformers.
    import torch
    import transformers

    from outrider.demo.tokenizer import encode_files, save_tokenizer, train_tokenizer
    from outrider.demo.train import greedy_agreement, held_out_loss, new_model, num_parameters, train_lm

    started = time.monotonic()
    log(f"building the {recipe.name!r} demo family (recipe {recipe.digest()}, seed {recipe.seed}) into {out}")
    train_files, held_files = corpus_mod.load_corpus()
    train_files = corpus_mod.every_kth(train_files, recipe.corpus_fraction)
    log(
        f"corpus: {len(train_files)} training files (fraction {recipe.corpus_fraction}), {len(held_files)} held-out files from {corpus_mod.stdlib_root()}"
    )

    tokenizer = train_tokenizer(train_files, recipe.tokenizer)
    vocab_size = tokenizer.get_vocab_size()
    eos_id = tokenizer.token_to_id(corpus_mod.EOS_TOKEN)
    train_stream = encode_files(tokenizer, train_files)
    held_stream = encode_files(tokenizer, held_files)
    held_chars = sum(len(f.text) for f in held_files)
    log(
        f"tokenizer: {vocab_size} tokens; {len(train_stream):,} training tokens, {len(held_stream):,} held-out"
    )

    target = new_model(recipe.target, vocab_size, eos_id, seed=recipe.seed)
    target_stats = train_lm(
        target,
        train_stream,
        recipe.target_train,
        context=recipe.target.context,
        seed=recipe.seed,
        desc="target",
        progress=progress,
    )
    target_loss = held_out_loss(target, held_stream, recipe.target.context, recipe.target_train.eval_windows)
    log(f"target: held-out loss {target_loss:.3f} nats/token after {target_stats.tokens_seen:,} tokens")

    draft = new_model(recipe.draft, vocab_size, eos_id, seed=recipe.seed + 1)
    draft_stats = train_lm(
        draft,
        train_stream,
        recipe.draft_train,
        context=recipe.draft.context,
        seed=recipe.seed + 1,
        desc="draft (distilled)",
        teacher=target,
        progress=progress,
    )
    draft_loss = held_out_loss(draft, held_stream, recipe.draft.context, recipe.draft_train.eval_windows)
    agreement = greedy_agreement(
        draft, target, held_stream, recipe.draft.context, recipe.draft_train.eval_windows
    )
    log(f"draft: held-out loss {draft_loss:.3f} nats/token, greedy agreement with target {agreement:.3f}")

    out.mkdir(parents=True)
    for folder in ("tokenizer", "target", "draft"):
        save_tokenizer(tokenizer, out / folder, model_max_length=recipe.target.context)
    target.save_pretrained(out / "target")
    draft.save_pretrained(out / "draft")

    def model_entry(model, stats, loss, context: int) -> dict:
        return {
            "parameters": num_parameters(model),
            "context": context,
            "steps": stats.steps,
            "tokens_seen": stats.tokens_seen,
            "train_seconds": round(stats.seconds, 1),
            "final_train_loss": round(stats.final_train_loss, 4),
            "held_out_loss": round(loss, 4),
        }

    manifest = {
        "format": RECIPE_FORMAT,
        "size": recipe.name,
        "seed": recipe.seed,
        "recipe_digest": recipe.digest(),
        "recipe": recipe.to_dict(),
        "corpus": {
            "source": "Python standard library of the building interpreter",
            "python": platform.python_version(),
            "train_files": len(train_files),
            "held_out_files": len(held_files),
            "held_out_rule": f"sha256(relative path)[0] < {corpus_mod.HELD_OUT_BYTE_BELOW}",
            "fingerprint": corpus_mod.corpus_fingerprint(train_files + held_files),
            "train_tokens": int(len(train_stream)),
            "held_out_tokens": int(len(held_stream)),
        },
        "tokenizer": {
            "vocab_size": vocab_size,
            "held_out_chars_per_token": round(held_chars / len(held_stream), 3),
        },
        "target": model_entry(target, target_stats, target_loss, recipe.target.context),
        "draft": {
            **model_entry(draft, draft_stats, draft_loss, recipe.draft.context),
            "trained_by": "distillation: KL(target || draft)",
            "greedy_agreement_with_target": round(agreement, 4),
        },
        "build": {
            "seconds": round(time.monotonic() - started, 1),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "torch_threads": torch.get_num_threads(),
        },
    }
    manifest["files"] = {
        p.relative_to(out).as_posix(): file_sha256(p) for p in sorted(out.rglob("*")) if p.is_file()
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    log(f"built in {manifest['build']['seconds']:.0f} s")


def export_family(family: DemoFamily, out: Path) -> Path:
    """Copy a verified family to `out` (e.g. a model volume); refuses to overwrite a non-empty folder."""
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and is not empty")
    shutil.copytree(family.root, out, dirs_exist_ok=True)
    return out
