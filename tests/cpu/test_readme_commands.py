"""Every command the README shows runs as written.

Each `outrider ...` line in the README's shell blocks parses with today's CLI (a renamed
flag or subcommand fails here), and the quick ones run for real as separate processes, as a
user types them: the `--help`s, `demo info`, and `draft-server` with every registered method
on the tiny family (`serve --demo tiny` runs from an installed wheel in test_wheel_install.py).
A user mistake on the command line is one line on stderr, never a traceback.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from cli_testlib import running, traceback_free

from outrider.cluster.cli import build_parser

REPO = Path(__file__).resolve().parents[2]
OUTRIDER = Path(sys.executable).parent / "outrider"


def readme_commands() -> list[list[str]]:
    """argv (after `outrider`) of each `outrider` line in the README's ```bash blocks."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", (REPO / "README.md").read_text(), re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words and Path(words[0]).name == "outrider":
                commands.append(words[1:])
    return commands


def test_the_readme_shows_outrider_commands():
    assert len(readme_commands()) >= 8


@pytest.mark.parametrize("argv", readme_commands(), ids=" ".join)
def test_readme_command_parses(argv):
    if "--help" in argv:
        with pytest.raises(SystemExit) as exit_info:
            build_parser().parse_args(argv)
        assert exit_info.value.code == 0
    else:
        build_parser().parse_args(argv)  # argparse exits with status 2 on a stale flag


def _run(*argv: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([OUTRIDER, *argv], capture_output=True, text=True, env=env, timeout=300)


def test_help_runs_as_a_command():
    result = _run("--help")
    assert result.returncode == 0 and "draft-server" in result.stdout


def test_demo_info_runs(outrider_home: Path, tiny_family):
    env = {**os.environ, "OUTRIDER_HOME": str(outrider_home)}
    found = _run("demo", "info", "--size", "tiny", env=env)
    assert found.returncode == 0 and str(tiny_family.root) in found.stdout
    missing = _run("demo", "info", "--size", "small", env={**env, "OUTRIDER_HOME": "/nonexistent/outrider"})
    assert missing.returncode == 1 and "outrider demo build" in missing.stderr
    assert traceback_free(missing.stderr)


@pytest.mark.parametrize(
    "argv, says",
    [
        (["draft-server", "--method", "no_such_method", "--port", "0"], "no_such_method"),
        (
            ["draft-server", "--method", "draft_model", "--model", "/nonexistent/draft", "--port", "0"],
            "/nonexistent/draft",
        ),
        (["serve", "--speculative-config", "{not json"], "JSON"),
        (["serve", "--demo", "huge"], "invalid choice"),
    ],
    ids=["unknown-method", "missing-folder", "bad-json", "bad-choice"],
)
def test_a_user_mistake_is_one_line_not_a_traceback(argv, says):
    result = _run(*argv)
    assert result.returncode == 2, result.stderr
    assert traceback_free(result.stderr), result.stderr
    assert says.lower() in result.stderr.lower()
    assert len([line for line in result.stderr.splitlines() if "error" in line.lower()]) == 1, result.stderr


def _methods() -> list[str]:
    from outrider import draft_worker

    return [m for m in draft_worker.known_methods() if not m.startswith("test_")]


@pytest.mark.slow
@pytest.mark.parametrize("method", _methods())
def test_draft_server_starts_for_each_method_on_the_tiny_family(method, outrider_home: Path, tiny_family):
    """The README's `outrider draft-server --method M --demo SIZE --port P`, without K."""
    env = {**os.environ, "OUTRIDER_HOME": str(outrider_home)}
    argv = [OUTRIDER, "draft-server", "--method", method, "--demo", "tiny", "--port", "0"]
    with running(argv, "draft server:", timeout_s=600, env=env) as lines:
        assert f"draft server: {method}" in "".join(lines)
    assert traceback_free("".join(lines)), "".join(lines)
