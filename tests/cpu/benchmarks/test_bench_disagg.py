"""`benchmarks.bench_disagg` end to end on the tiny family: a draft server process per mode,
the round trip, and every mode at two batch sizes (a smoke run: figures are not checked)."""

from __future__ import annotations

import json

import pytest
import torch


@pytest.fixture
def keep_torch_threads():
    """main() sets one torch thread for the whole process; later tests (a demo family rebuilt
    byte for byte) must run with the thread count the session started with."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_bench_disagg_runs_every_mode_and_reports_it(tiny_family, tmp_path, keep_torch_threads):
    from outrider.benchmarks import bench_disagg

    argv = ["--size", "tiny", "--max-tokens", "8", "--repeats", "1", "--batches", "1,2"]
    argv += ["--methods", "ngram", "--iterations", "5", "--no-pin", "--results-dir", str(tmp_path)]
    assert bench_disagg.main(argv) == 0
    rows = json.loads((tmp_path / "disagg_tiny.json").read_text())["results"]
    assert {r["measure"] for r in rows} == {"core_contention", "round_trip", "tokens_per_s"}
    modes = {(r["batch"], r["mode"]) for r in rows if r["measure"] == "tokens_per_s"}
    assert modes == {(b, m) for b in (1, 2) for m in bench_disagg_modes()}
    for row in rows:
        if row.get("mode", "").startswith("disaggregated"):
            assert row["cache_on"] == row["mode"].endswith("cache")
            assert row["tokens_per_s"] > 0
            if row["batch"] == 2:  # the engine chose its lanes by measuring: the share is reported
                assert 0 <= row["two_lane_share"] <= 1
    assert (tmp_path / "disagg_tiny.md").exists()


def bench_disagg_modes() -> list[str]:
    return ["plain", "co-located", "disaggregated", "disaggregated+cache"]
