"""The repository installs as one `outrider` namespace, and its rooms keep the design's shape.

- every folder with an `__init__.py` ships in the wheel (pyproject's `packages` list);
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
        for path in (REPO / folder).rglob("*.py")
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
    listed = set(PYPROJECT["tool"]["setuptools"]["packages"])
    on_disk = {
        "outrider." + ".".join(init.parent.relative_to(REPO).parts)
        for folder in FOLDERS
        for init in (REPO / folder).rglob("__init__.py")
    }
    assert on_disk - listed == set(), "add these to [tool.setuptools] packages in pyproject.toml"
    assert listed - on_disk == set(), "pyproject.toml lists packages that do not exist"
    mapping = PYPROJECT["tool"]["setuptools"]["package-dir"]
    assert mapping == {f"outrider.{folder}": folder for folder in FOLDERS}


def test_no_import_goes_upward():
    upward = []
    for path in _sources():
        rel = path.relative_to(REPO).as_posix()
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
