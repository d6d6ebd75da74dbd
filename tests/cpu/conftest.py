"""Session-wide fixtures for the CPU suite.

The tiny demo family is built once per test run into a temporary OUTRIDER_HOME and shared
by every test that needs a real model (never built per test). For repeated local runs, set
OUTRIDER_TEST_HOME to a folder: the family is built there once and reused by later runs
(CI leaves it unset, so every run there starts from nothing).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

# Each folder's `*_testlib.py` helpers import by their (unique) module name from any test
# folder; appended, so nothing here shadows an installed package.
for _folder in sorted(Path(__file__).parent.iterdir()):
    if _folder.is_dir() and not _folder.name.startswith((".", "_")) and str(_folder) not in sys.path:
        sys.path.append(str(_folder))


@pytest.fixture(scope="session")
def outrider_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    kept = os.environ.get("OUTRIDER_TEST_HOME")
    home = Path(kept) if kept else tmp_path_factory.mktemp("outrider_home")
    home.mkdir(parents=True, exist_ok=True)
    previous = os.environ.get("OUTRIDER_HOME")
    os.environ["OUTRIDER_HOME"] = str(home)
    yield home
    if previous is None:
        os.environ.pop("OUTRIDER_HOME", None)
    else:
        os.environ["OUTRIDER_HOME"] = previous


@pytest.fixture(scope="session")
def tiny_family(outrider_home: Path):
    """The tiny demo family (tokenizer, target, draft), built once for the session."""
    from outrider.demo.family import ensure_demo_family

    return ensure_demo_family("tiny", home=outrider_home, progress=False, log=lambda _: None)


@pytest.fixture(scope="session")
def tokenizer(tiny_family):
    """The tiny family's tokenizer, loaded with `transformers` as users load it."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_family.tokenizer_dir)
