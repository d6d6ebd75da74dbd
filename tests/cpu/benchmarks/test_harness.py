"""The shared benchmark harness: held-out prompt sets and the report format."""

from __future__ import annotations

import json

import pytest

from outrider.benchmarks.prompts import load_prompts
from outrider.benchmarks.report import DecodeRow, write_report
from outrider.demo.corpus import is_held_out


@pytest.mark.parametrize("name", ["start", "mid"])
def test_prompt_sets_are_held_out_deterministic_and_sized(tokenizer, name):
    prompts = load_prompts(name, tokenizer, count=6, prompt_tokens=64)
    assert prompts == load_prompts(name, tokenizer, count=6, prompt_tokens=64)
    assert len(prompts) == 6 and len({p.source for p in prompts}) == 6
    for p in prompts:
        assert is_held_out(p.source)
        assert len(p.token_ids) == 64


def test_mid_prompts_are_not_file_starts(tokenizer):
    starts = {p.source: p.token_ids for p in load_prompts("start", tokenizer, count=20, prompt_tokens=32)}
    for p in load_prompts("mid", tokenizer, count=6, prompt_tokens=32):
        if p.source in starts:
            assert p.token_ids != starts[p.source]


def test_unknown_set_is_refused(tokenizer):
    with pytest.raises(ValueError, match="unknown prompt set"):
        load_prompts("end", tokenizer)


def test_report_writes_json_rows_and_markdown(tmp_path):
    rows = [
        DecodeRow("plain", "mid", 0.0, 100.0, 1.0, None).to_dict(),
        DecodeRow(
            "ngram", "mid", 0.0, 150.0, 1.5, 2.1, extra={"accepted_per_position": [0.6, 0.3]}
        ).to_dict(),
    ]
    json_path, md_path = write_report("demo", rows, {"model": "tiny"}, title="Demo", results_dir=tmp_path)
    report = json.loads(json_path.read_text())
    assert report["meta"]["model"] == "tiny" and "torch" in report["meta"]
    for row in report["results"]:
        for key in (
            "method",
            "prompt_set",
            "temperature",
            "tokens_per_s",
            "speedup_vs_plain",
            "acceptance_length",
        ):
            assert key in row
    assert report["results"][1]["accepted_per_position"] == [0.6, 0.3]
    md = md_path.read_text()
    assert md.startswith("# Demo") and "| plain | mid |" in md
