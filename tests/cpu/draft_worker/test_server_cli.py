"""`outrider draft-server` as the README runs it: every registered method builds on the demo
family without `--num-speculative-tokens`, and a user mistake is a one-line ValueError (or
FileNotFoundError), which the `outrider` entry point prints as `outrider: error: ...`."""

import argparse
from pathlib import Path

import pytest

from outrider.draft_worker import known_methods
from outrider.draft_worker.proposer import proposer_class
from outrider.draft_worker.server_cli import add_draft_server_parser, build_server_proposer
from outrider.proto import DEFAULT_NUM_SPECULATIVE_TOKENS


def demo_folder(family, method: str) -> Path:
    """The drafter folder `--demo tiny` gives `method`: its trained head (built once per
    session), else the family's draft LM."""
    from outrider.draft_worker.training.demo_heads import demo_head_dir, head_methods

    if method in head_methods():
        return demo_head_dir(family, method, progress=False, log=lambda _: None)
    return family.draft_dir


@pytest.mark.parametrize("method", known_methods())
def test_every_method_builds_without_k(tiny_family, method):
    folder = demo_folder(tiny_family, method)
    proposer = build_server_proposer(method, {}, folder, tiny_family.tokenizer_dir)
    assert proposer.method == method
    own_default = proposer_class(method).default_num_speculative_tokens
    assert proposer.config.num_speculative_tokens == (own_default or DEFAULT_NUM_SPECULATIVE_TOKENS)


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="outrider")
    add_draft_server_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["draft-server", "--port", "0", *argv])


@pytest.mark.parametrize(
    ("argv", "error", "message"),
    [
        (["--method", "eagle9", "--tokenizer", "{tok}"], ValueError, "unknown speculative method 'eagle9'"),
        (["--method", "ngram", "--model", "{tmp}/nowhere"], FileNotFoundError, "no such folder"),
        (["--method", "ngram", "--tokenizer", "{tmp}"], FileNotFoundError, "tokenizer.json: no such file"),
        (["--method", "ngram"], ValueError, "give --tokenizer"),
        (["--method", "ngram", "--demo", "tiny"], ValueError, "no demo resolver"),
        (
            ["--method", "ngram", "--tokenizer", "{tok}", "--speculative-config", "{"],
            ValueError,
            "not valid JSON",
        ),
        (
            ["--method", "ngram", "--tokenizer", "{tok}", "--speculative-config", "[1]"],
            ValueError,
            "JSON object",
        ),
        (
            ["--method", "ngram", "--tokenizer", "{tok}", "--speculative-config", '{"prompt_lookup": 2}'],
            ValueError,
            r"unknown keys \['prompt_lookup'\]",
        ),
        (["--method", "ngram", "--tokenizer", "{tok}", "--tls-cert", "c.pem"], ValueError, "go together"),
    ],
)
def test_user_mistakes_are_one_line_errors(tiny_family, tmp_path, argv, error, message):
    argv = [a.replace("{tok}", str(tiny_family.tokenizer_dir)).replace("{tmp}", str(tmp_path)) for a in argv]
    args = parse(*argv)
    with pytest.raises(error, match=message) as raised:
        args.func(args)
    assert "\n" not in str(raised.value)


@pytest.mark.parametrize("value", ["0", "-3"])
def test_max_sequences_below_one_is_refused_by_the_parser(value, capsys):
    with pytest.raises(SystemExit) as exited:
        parse("--method", "ngram", "--max-sequences", value)
    assert exited.value.code == 2 and "must be at least 1" in capsys.readouterr().err
