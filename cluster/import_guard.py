"""Make sure `import proto` / `import kernels` give Outrider's packages.

Two unrelated PyPI distributions install top-level packages with our names:
`proto-plus` installs `proto` (pulled in by ray[serve] -> opencensus -> google-api-core) and
Hugging Face's `kernels` installs `kernels`. Whichever comes first on `sys.path` wins, and a
wrong `proto` fails far from the cause. The Makefile removes `proto-plus` after installing
(nothing Ray Serve runs imports it), and every entry point calls `check_import_names()` so a
shadowed package is reported at start-up with the distribution that owns it.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from pathlib import Path

OUR_PACKAGES = ("proto", "kernels", "target_worker", "draft_worker", "cluster")
REPO_ROOT = Path(__file__).resolve().parents[1]


class ImportClashError(ImportError):
    """An unrelated installed package shadows one of Outrider's top-level packages."""


def check_import_names() -> None:
    for name in OUR_PACKAGES:
        module = importlib.import_module(name)
        file = getattr(module, "__file__", None)
        if file is not None and Path(file).resolve().parent.parent == REPO_ROOT:
            continue
        owners = importlib.metadata.packages_distributions().get(name, ["an unknown distribution"])
        raise ImportClashError(
            f"`import {name}` resolved to {file or 'a namespace package'} (from {', '.join(owners)}), "
            f"not Outrider's {REPO_ROOT / name}. Uninstall it (`pip uninstall {owners[0]}`) or run "
            f"from a virtual environment made by `make install`."
        )
