"""The demo corpus: the Python standard library source of the running interpreter.

Every machine that runs Outrider has it, so the demo family needs no download.

What is in it: every `*.py` file under `sysconfig.get_paths()["stdlib"]`, outside
`site-packages`, that decodes as UTF-8 and parses as Python 3. That keeps the stdlib's own
tests (they are Python) and drops test *data* that is not valid Python 3 (lib2to3's Python 2
grammar samples, deliberately broken or Latin-1 encoded files).

The held-out split is fixed and documented: a file is held out when the first byte of
sha256 of its path relative to the stdlib root (POSIX separators) is below
`HELD_OUT_BYTE_BELOW` (13/256, about 5% of files). It depends only on the path, so it is
the same on every machine with the same Python version and does not move when files are
added elsewhere. Evaluation and benchmarks draw prompts from held-out files only.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import sysconfig
import warnings
from dataclasses import dataclass
from pathlib import Path

HELD_OUT_BYTE_BELOW = 13
# Separates files in the training stream; also the tokenizer's end-of-text token.
EOS_TOKEN = "<|endoftext|>"


@dataclass(frozen=True)
class SourceFile:
    path: str  # relative to the stdlib root, POSIX separators
    text: str


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_held_out(relative_path: str) -> bool:
    return hashlib.sha256(relative_path.encode()).digest()[0] < HELD_OUT_BYTE_BELOW


def _read_python3(path: Path) -> str | None:
    try:
        text = path.read_text(encoding="utf-8")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # invalid escape sequences in old test files
            compile(text, str(path), "exec", flags=ast.PyCF_ONLY_AST, dont_inherit=True)
    except (UnicodeDecodeError, SyntaxError, ValueError):
        return None
    return text


def load_corpus(root: Path | None = None) -> tuple[list[SourceFile], list[SourceFile]]:
    """Return (train, held_out) files, each sorted by path (new lists; parsed once per process)."""
    train, held_out = _load_corpus(root or stdlib_root())
    return list(train), list(held_out)


@functools.lru_cache(maxsize=2)
def _load_corpus(root: Path) -> tuple[tuple[SourceFile, ...], tuple[SourceFile, ...]]:
    train: list[SourceFile] = []
    held_out: list[SourceFile] = []
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root)
        if "site-packages" in relative.parts:
            continue
        text = _read_python3(path)
        if text is None or not text.strip():
            continue
        entry = SourceFile(relative.as_posix(), text)
        (held_out if is_held_out(entry.path) else train).append(entry)
    if not train or not held_out:
        raise RuntimeError(f"no usable Python source under {root}: cannot build the demo corpus")
    return tuple(train), tuple(held_out)


def every_kth(files: list[SourceFile], fraction: float) -> list[SourceFile]:
    """A deterministic subset of about `fraction` of the files: every k-th by path."""
    if not 0 < fraction <= 1:
        raise ValueError(f"corpus fraction must be in (0, 1], got {fraction}")
    return files[:: max(1, round(1 / fraction))]


def corpus_fingerprint(files: list[SourceFile]) -> str:
    """A short hash of the file list and contents, recorded in the demo manifest."""
    digest = hashlib.sha256()
    for f in files:
        digest.update(f.path.encode())
        digest.update(hashlib.sha256(f.text.encode()).digest())
    return digest.hexdigest()[:16]
