"""`outrider` CLI: every subcommand has a useful --help; the install check passes."""

from __future__ import annotations

import pytest

from outrider.cluster.cli import build_parser, main


def _help(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--help"])
    assert exit_info.value.code == 0
    return capsys.readouterr().out


def test_top_level_help_lists_subcommands(capsys):
    text = _help(capsys)
    for command in ("demo", "generate", "check-install"):
        assert command in text


def _all_commands(parser, prefix=()):
    for action in parser._actions:
        if action.__class__.__name__ == "_SubParsersAction":
            for name, sub in action.choices.items():
                yield (*prefix, name), sub
                yield from _all_commands(sub, (*prefix, name))


@pytest.mark.parametrize("argv", [argv for argv, _ in _all_commands(build_parser())], ids=" ".join)
def test_every_subcommand_has_help(capsys, argv):
    text = _help(capsys, *argv)
    assert "usage: outrider " + " ".join(argv) in text
    assert len(text.splitlines()) >= 3


def test_missing_subcommand_is_an_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([])
    assert exit_info.value.code == 2


def test_check_install_names_where_each_package_comes_from(capsys):
    from pathlib import Path

    import outrider.cluster

    assert main(["check-install"]) == 0
    out = capsys.readouterr().out
    assert f"outrider.cluster        {Path(outrider.cluster.__file__).parent}" in out
    assert "outrider.benchmarks" in out


def test_demo_info_reports_missing_family(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("OUTRIDER_HOME", str(tmp_path))
    assert main(["demo", "info", "--size", "tiny"]) == 1
    assert "outrider demo build --size tiny" in capsys.readouterr().err


def test_generate_from_the_tiny_demo(capsys, tiny_family):
    assert (
        main(
            [
                "generate",
                "--model",
                str(tiny_family.target_dir),
                "--prompt",
                "import",
                "--max-new-tokens",
                "5",
            ]
        )
        == 0
    )
    assert capsys.readouterr().out.startswith("import")
