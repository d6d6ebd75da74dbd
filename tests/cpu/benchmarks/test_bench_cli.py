"""`outrider bench`: the quick run exercises every path and writes a report that matches its schema."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math

import jsonschema
import pytest
import torch

from outrider.benchmarks.bench import add_bench_arguments, method_table, resolve_defaults, resolve_models
from outrider.benchmarks.bench_schema import SCHEMA
from outrider.cluster import cli

METHODS = ["draft_model", "eagle3", "medusa", "mtp", "ngram", "peagle", "suffix"]


def _numbers(value, path="$"):
    """Every number in a JSON value, with where it sits."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _numbers(item, f"{path}.{key}")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from _numbers(item, f"{path}[{i}]")
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        yield path, value


def _refuse_constant(name):
    raise ValueError(f"{name} in the JSON report")


@pytest.fixture
def quick_heads(monkeypatch):
    """Tiny heads trained for a few steps: the bench's paths are under test here, not head quality."""
    from outrider.draft_worker.training import demo_heads as heads

    for method in heads.head_methods():
        recipe = dataclasses.replace(heads.head_recipe("tiny", method), steps=4)
        monkeypatch.setitem(heads.HEAD_RECIPES["tiny"], method, recipe)


def test_bench_quick_json(tiny_family, quick_heads, tmp_path, capsys):
    from outrider.draft_worker import known_methods

    out = tmp_path / "out.json"
    threads = torch.get_num_threads()
    try:
        assert cli.main(["bench", "--quick", "--json", str(out)]) == 0
    finally:  # the bench pins torch's threads for its process; later tests build with the default
        torch.set_num_threads(threads)
    report = json.loads(out.read_text(), parse_constant=_refuse_constant)
    jsonschema.validate(report, SCHEMA)
    for path, number in _numbers(report):
        assert math.isfinite(number), path

    # Every registered method ran or is listed as skipped with its reason; the built-in ones
    # all ran (the tiny family has a head for each). Other tests may register methods of their own.
    ran = {r["config"]["method"] for r in report["results"] if r["config"]}
    skipped = {s["method"] for s in report["skipped"]}
    assert ran | skipped == set(known_methods()) and not ran & skipped
    assert set(METHODS) <= ran
    cells = {(r["prompt_set"], r["temperature"]) for r in report["results"]}
    assert cells == {("mid", 0.0), ("mid", 1.0), ("start", 0.0), ("start", 1.0)}
    for row in report["results"]:
        if row["method"] == "plain":
            assert row["speedup_vs_plain"] == 1.0 and row["target_forwards_per_token"] == 1.0
            # Plain beside its plain partner (the control): measured, so not 1 by construction
            # as a ratio of plain's runs to themselves would be.
            assert row["speedup_paired"] > 0 and row["speedup_paired"] != 1.0
        if row["temperature"] == 0:  # lossless: speculative greedy output is plain greedy output
            assert row["greedy_identical"] == 1.0, row["method"]
        else:
            assert row["greedy_identical"] is None
        if (row["acceptance_length"] or 0) > 1:  # accepted drafts save target forwards
            assert row["target_forwards_per_token"] < 1.0

    peers = {(p["name"], p["prompt_set"], p["temperature"]) for p in report["peers"]}
    assert {name for name, _, _ in peers} == {"hf-plain", "hf-assisted", "hf-assisted-k4", "hf-prompt-lookup"}
    assert len(peers) == 16
    hf_plain = [p for p in report["peers"] if p["name"] == "hf-plain"]
    assert all(p["target_forwards_per_token"] == 1.0 for p in hf_plain)
    assert [line["temperature"] for line in report["headline"]] == [0.0, 1.0]
    (cost,) = report["sampling_cost"]  # plain at T = 1 beside plain at T = 0
    assert (
        cost["temperature"] == 1.0
        and cost["runs"] == report["meta"]["prompts_per_set"] * report["meta"]["repeats"]
    )
    assert cost["speedup_vs_greedy"] > 0
    assert all(line["speedup_vs_hf_assisted"] > 0 for line in report["headline"])

    sizes = [r["tree_nodes"] for r in report["tree_sweep"] if r["method"] != "plain"]
    assert len(sizes) >= 2 and report["meta"]["tree_sweep_method"]
    serving = {r["variant"]: r for r in report["serving"]}
    assert set(serving) == {"off", "colocated", "disaggregated"}
    assert serving["off"]["acceptance_length"] is None
    assert serving["colocated"]["acceptance_length"] is not None
    assert serving["disaggregated"]["acceptance_length"] is not None

    stem = out.with_suffix("")
    md = stem.with_suffix(".md").read_text()
    assert "best method" in md and "## Serving" in md and "Plain decoding at T = 1" in md
    for suffix in ("methods", "tree_size", "serving"):
        png = stem.with_name(f"{stem.name}_{suffix}.png")
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"]({png.name})" in md
    assert "headline T=0" in capsys.readouterr().out


def test_bench_is_a_subcommand_with_help(capsys):
    with pytest.raises(SystemExit):
        cli.main(["bench", "--help"])
    text = capsys.readouterr().out
    assert "--quick" in text and "transformers" in text and "--schema" in text
    assert cli.main(["bench", "--schema"]) == 0
    assert json.loads(capsys.readouterr().out) == SCHEMA


def test_methods_without_a_head_are_skipped_with_a_reason(tmp_path):
    parser = argparse.ArgumentParser()
    add_bench_arguments(parser)
    args = resolve_defaults(
        parser.parse_args(["--model", str(tmp_path), "--head", f"medusa={tmp_path / 'm'}"])
    )
    models = resolve_models(args, METHODS, log=lambda _: None)
    reasons = {s["method"]: s["reason"] for s in models.skipped}
    assert set(reasons) == {"draft_model", "eagle3", "mtp", "peagle"}
    assert "--draft" in reasons["draft_model"] and all(
        "--head" in reasons[m] for m in ("eagle3", "mtp", "peagle")
    )
    table = method_table(models, METHODS)
    assert {c["method"] for c in table.values() if c} == {"ngram", "suffix", "medusa"}
    assert next(iter(table)) == "plain"


@pytest.mark.parametrize(
    "argv, said",
    [
        (["--concurrency", "0"], "--concurrency: 0 is not at least 1"),
        (["--concurrency", "1,x"], "--concurrency: 'x' is not a whole number"),
        (["--tree-sizes", "4,-8"], "--tree-sizes: -8 is not at least 1"),
        (["--prompts", "0"], "--prompts: 0 is not at least 1"),
        (["--serve-requests", "-2"], "--serve-requests: -2 is not at least 1"),
    ],
)
def test_bench_refuses_counts_below_one_before_it_runs(argv, said, capsys):
    """`--concurrency 0` ran every configuration, then failed serving (`max_workers must be
    greater than 0`): a count is checked as it is parsed."""
    parser = argparse.ArgumentParser(prog="outrider bench")
    add_bench_arguments(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(argv)
    assert said in capsys.readouterr().err
    args = resolve_defaults(parser.parse_args(["--concurrency", "", "--tree-sizes", "4,8"]))
    assert (args.concurrency, args.tree_sizes) == ("", "4,8")  # empty: no serving
