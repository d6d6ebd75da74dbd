"""The repository installs as one `outrider` package, and its rooms keep the design's shape.

- every package lives under outrider/ (nothing else at the checkout's root imports), and every
  folder there with Python files has an `__init__.py`, so the wheel's package search finds it;
- no import goes upward (docs/architecture.md, "Layout"): proto <- kernels <- target_worker
  <- draft_worker <- cluster, with demo a leaf that draft_worker and cluster import from below;
  cluster reaches benchmarks only inside the `bench` command;
- no source file outside the generated stubs is over 450 lines;
- nothing imports Outrider's folders by their bare names (ruff's TID251 rule, run here).
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import tomllib

REPO = Path(__file__).resolve().parents[2]
SOURCE = REPO / "outrider"
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
FOLDERS = ("proto", "kernels", "target_worker", "draft_worker", "demo", "cluster", "benchmarks")
MAX_LINES = 450

# What each package may import from Outrider (itself included).
ALLOWED = {
    "proto": {"proto"},
    "kernels": {"proto", "kernels"},
    "target_worker": {"proto", "kernels", "target_worker"},
    "draft_worker": {"proto", "kernels", "target_worker", "draft_worker", "demo"},
    "demo": {"demo"},
    "cluster": {"proto", "kernels", "target_worker", "draft_worker", "demo", "cluster"},
    "benchmarks": set(FOLDERS),
}
# Upward imports that are allowed where they are: the CLI's `bench` subcommand lives in benchmarks.
EXCEPTIONS = {("cluster/cli.py", "benchmarks")}


def _sources() -> list[Path]:
    return sorted(
        path
        for folder in FOLDERS
        for path in (SOURCE / folder).rglob("*.py")
        if not path.name.endswith(("_pb2.py", "_pb2_grpc.py"))
    )


def _outrider_imports(path: Path) -> set[str]:
    """The Outrider packages `path` imports (`outrider.<package>...`), at any depth in the file."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [
                f"{node.module}.{a.name}" for a in node.names if node.module == "outrider"
            ]
        for name in names:
            parts = name.split(".")
            if parts[0] == "outrider" and len(parts) > 1:
                found.add(parts[1])
    return found


def test_every_package_folder_ships_in_the_wheel():
    assert PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"] == ["outrider", "outrider.*"]
    assert sorted(p.name for p in SOURCE.iterdir() if p.is_dir() and p.name != "__pycache__") == sorted(
        FOLDERS
    )
    # find_packages skips a folder without an __init__.py: its modules would be missing from the wheel.
    folders = {path.parent for path in SOURCE.rglob("*.py") if "__pycache__" not in path.parts}
    missing = sorted(str(f.relative_to(REPO)) for f in folders if not (f / "__init__.py").is_file())
    assert missing == [], "add an __init__.py to these folders"


def test_nothing_at_the_root_imports_but_outrider():
    """A checkout's root is on sys.path under `python -m` there: a package at the root would shadow
    an installed one of the same name (`kernels` and `proto` are real PyPI packages)."""
    importable = sorted(
        p.name
        for p in REPO.iterdir()
        if (p.suffix == ".py" and p.is_file())
        or (p / "__init__.py").is_file()
        or (p.is_dir() and not p.name.startswith(".") and any(p.glob("*.py")))
    )
    assert importable == ["outrider"]


def test_no_import_goes_upward():
    upward = []
    for path in _sources():
        rel = path.relative_to(SOURCE).as_posix()
        package = rel.split("/")[0]
        for target in sorted(_outrider_imports(path) - ALLOWED[package]):
            if (rel, target) not in EXCEPTIONS:
                upward.append(f"{rel} imports outrider.{target}")
    assert upward == []


def test_no_source_file_is_over_the_line_limit():
    long = [
        f"{path.relative_to(REPO)} ({n} lines)"
        for path in _sources()
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    ]
    assert long == [], f"split these by concept (STYLE: one concept per file, <= {MAX_LINES} lines)"


def test_no_bare_package_imports():
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    assert ruff is not None, "ruff (the `test` extra) is not installed"
    result = subprocess.run(
        [ruff, "check", "--no-cache", "--select", "TID251", "--output-format", "concise", "."],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_wire_contract_ships_with_the_package():
    package_data = PYPROJECT["tool"]["setuptools"]["package-data"]["outrider.proto"]
    assert {"*.proto", "*.pyi"} <= set(package_data)
