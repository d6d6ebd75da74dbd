"""The HTTP sweep's bookkeeping (the sweep itself needs a served family: run it by hand)."""

import pytest

from outrider.benchmarks.bench_http_sweep import speculative_config, summary


def test_adaptive_drafts_up_to_the_largest_fixed_k():
    assert speculative_config("ngram", "adaptive", [1, 4]) == {
        "method": "ngram",
        "num_speculative_tokens": 4,  # the ceiling: the largest fixed K compared
        "budget_policy": "adaptive",
    }
    assert speculative_config("ngram", "K1", [1, 4])["budget_policy"] == "fixed"


def test_the_summary_puts_adaptive_beside_the_best_fixed_k_at_each_point():
    def row(budget, speedup, concurrency=1):
        return {
            "method": "ngram",
            "placement": "colocated",
            "budget": budget,
            "temperature": 0.0,
            "concurrency": concurrency,
            "speedup_vs_off": speedup,
        }

    off = {"method": "off", "placement": "—", "budget": "—", "temperature": 0.0, "concurrency": 1}
    rows = [off, row("adaptive", 1.5), row("K1", 1.2), row("K4", 1.6), row("K4", 0.9, concurrency=4)]
    by_level = {r["concurrency"]: r for r in summary(rows)}
    assert by_level[1]["best_fixed"] == "K4" and by_level[1]["best_fixed_vs_off"] == 1.6
    assert abs(by_level[1]["adaptive_vs_best_fixed"] - 1.5 / 1.6) < 1e-9
    assert by_level[4]["adaptive_vs_off"] is None and by_level[4]["adaptive_vs_best_fixed"] is None
    assert by_level[1]["control_vs_off"] is None  # measured without the A/A control
    # With it, each point carries its own: the same speculation-off server's ratio to off
    controlled = [{**r, "control_vs_off": 0.97 if r["concurrency"] == 1 else 1.04} for r in rows[1:]]
    control = {**off, "method": "off-b", "speedup_vs_off": 0.97}  # its own row in the detail
    summarised = summary([off, control, *controlled])
    assert [r["method"] for r in summarised] == ["ngram", "ngram"]  # the control is no point of its own
    by_level = {r["concurrency"]: r for r in summarised}
    assert by_level[1]["control_vs_off"] == 0.97 and by_level[4]["control_vs_off"] == 1.04
    assert by_level[1]["best_fixed"] == "K4"  # the control is no fixed K


def test_rotated_levels_mirror_the_order_and_merge_each_applications_blocks(monkeypatch):
    from outrider.benchmarks import bench_http_sweep as sweep
    from outrider.benchmarks.loadgen import RequestRecord

    calls = []

    def fake_block(url, requests, first, **level):
        calls.append((url, first, requests))
        tokens = 10 if url == "off" else 30  # per request
        records = [
            RequestRecord(0.0, 1.0, True, "stream", True, tokens=tokens, ttft_s=0.1, itl_s=[0.01])
            for _ in range(requests)
        ]
        drafts = 0.0 if url == "off" else 4.0 * (first + 1)
        return records, 2.0, {"drafts": 0.0, "accepted": 0.0}, {"drafts": drafts, "accepted": drafts / 2}

    monkeypatch.setattr(sweep, "run_block", fake_block)
    measured = sweep.rotated_levels([("off", "off"), ("K2", "spec")], 2, requests=8, concurrency=4)
    # A B B A, the second half's prompts after the first's
    assert calls == [("off", 0, 4), ("spec", 0, 4), ("spec", 4, 4), ("off", 4, 4)]
    calls.clear()
    sweep.rotated_levels([("off", "off"), ("K1", "a"), ("K2", "b")], 3, requests=3, concurrency=1)
    assert [url for url, _, _ in calls] == ["off", "a", "b", "b", "a", "off", "off", "a", "b"]
    assert measured["off"]["output_tok_s"] == 8 * 10 / 4.0  # both blocks' tokens over both walls
    assert measured["K2"]["output_tok_s"] == 8 * 30 / 4.0
    assert measured["off"]["acceptance_length"] is None
    assert measured["K2"]["acceptance_length"] == 1.5  # counters summed over the blocks


def test_the_metrics_page_gives_the_policys_budgets_per_level(monkeypatch):
    """Mean budget depth and the share of sequence-rounds at depth 0, from the
    spec_decode_draft_depth histogram's deltas over the level."""
    import io

    from outrider.benchmarks import bench_http_sweep as sweep

    def page(counts):  # sequence-rounds per depth 0, 1, 2
        cumulative, lines = 0, ["# TYPE outrider:spec_decode_draft_depth histogram"]
        for depth, n in enumerate(counts):
            cumulative += n
            lines.append(
                f'outrider:spec_decode_draft_depth_bucket{{model_name="m",le="{depth}"}} {cumulative}'
            )
        lines.append(f'outrider:spec_decode_draft_depth_count{{model_name="m"}} {cumulative}')
        lines.append(f'outrider:spec_decode_draft_depth_sum{{model_name="m"}} {counts[1] + 2 * counts[2]}')
        return "\n".join(lines).encode()

    pages = iter([page([10, 0, 5]), page([16, 0, 7])])  # over the level: 6 at 0, 2 at depth 2
    monkeypatch.setattr(sweep.urllib.request, "urlopen", lambda *a, **k: io.BytesIO(next(pages)))
    before, after = sweep.spec_counters("x"), sweep.spec_counters("x")
    from outrider.benchmarks.loadgen import RequestRecord

    record = RequestRecord(0.0, 1.0, True, "stream", True, tokens=8, ttft_s=0.1, itl_s=[0.01])
    figures = sweep.level_figures([([record], 1.0, before, after)])
    assert figures["mean_budget_depth"] == 4 / 8 and figures["budget_off_share"] == 6 / 8


def test_every_client_sends_per_client_requests_a_block_so_a_level_is_not_one_wave(monkeypatch):
    import argparse

    from outrider.benchmarks import bench_http_sweep as sweep

    sizes = []
    monkeypatch.setattr(
        sweep, "rotated_levels", lambda apps, halves, **level: sizes.append(level["requests"])
    )
    args = argparse.Namespace(requests=64, halves=2, per_client=2, max_tokens=8)
    for concurrency in (1, 4, 16, 64):
        sweep.measure_level([], args, False, "m", [], concurrency, 0.0, False, True)
    # 64 at most c = 16 (32 a block: 2 for each of 16 clients); 2 x 2 x 64 at c = 64
    assert sizes == [64, 64, 64, 256]
    args.per_client = 1
    sweep.measure_level([], args, False, "m", [], 64, 0.0, False, True)
    assert sizes[-1] == 128  # one wave a block
    assert sweep.level_parser("x").parse_args([]).per_client == 2


def test_the_control_is_on_by_default_and_off_with_no_control(monkeypatch):
    from outrider.benchmarks import bench_http_sweep as sweep

    seen = []
    monkeypatch.setattr(sweep, "sweep", lambda args: seen.append(args.control) or [])
    monkeypatch.setattr(sweep, "write_run_report", lambda *a, **k: None)
    sweep.main(["--size", "tiny"])
    sweep.main(["--size", "tiny", "--no-control"])
    assert seen == [True, False]


def test_full_concurrency_rate_counts_the_tokens_streamed_while_every_client_was_busy():
    """From a block's first request start to its last's: after that answers leave and none
    replace them. Two clients, four requests: plain ends each wave in one round; speculation
    ends its requests apart and its last runs alone, which the whole block's rate counts and
    this one leaves out."""
    from outrider.benchmarks.bench_http_sweep import full_concurrency_rate
    from outrider.benchmarks.loadgen import RequestRecord

    def record(start, end, tokens=10):  # a token every (end - start) / tokens seconds
        times = [(start + (end - start) * (i + 1) / tokens, i + 1) for i in range(tokens)]
        return RequestRecord(start, end - start, True, "stream", True, tokens=tokens, token_times=times)

    plain = [record(0, 1), record(0, 1), record(1, 2), record(1, 2)]
    assert full_concurrency_rate([plain]) == 20 / 1  # the first wave's tokens over [0, 1]
    spec = [record(0, 0.5), record(0, 0.8), record(0.5, 1.0), record(0.8, 1.6)]
    # by 0.8: 10 + 10 + 6 (third request, 0.3 s of its 0.5) + 0 (the last starts then)
    assert full_concurrency_rate([spec]) == pytest.approx(26 / 0.8)
    assert full_concurrency_rate([plain, spec]) == pytest.approx((20 + 26) / 1.8)  # pooled over blocks
    assert full_concurrency_rate([plain[:2]]) is None  # one wave: no stretch with every client busy
    no_usage = [RequestRecord(r.start, r.latency_s, True, "stream", True, tokens=10) for r in plain]
    assert full_concurrency_rate([no_usage]) is None  # a server that sent usage only at the end


def test_the_summary_gives_the_full_concurrency_ratios_beside_the_whole_blocks():
    def row(budget, whole, full):
        point = {"method": "ngram", "placement": "colocated", "temperature": 0.0, "concurrency": 16}
        return point | {"budget": budget, "speedup_vs_off": whole, "full_concurrency_speedup": full}

    rows = [row("adaptive", 0.95, 1.10), row("K1", 0.97, 1.05), row("K2", 0.90, 1.12)]
    (cell,) = summary([{**r, "control_vs_off": 1.01, "control_full_concurrency": 0.99} for r in rows])
    assert (cell["best_fixed"], cell["full_best_fixed"]) == ("K1", "K2")  # each measure its own best
    assert cell["adaptive_vs_best_fixed"] == pytest.approx(0.95 / 0.97)
    assert cell["full_adaptive_vs_best_fixed"] == pytest.approx(1.10 / 1.12)
    assert (cell["control_vs_off"], cell["full_control_vs_off"]) == (1.01, 0.99)
    (unmeasured,) = summary([{**row("adaptive", 1.0, None)}, row("K1", 1.0, None)])
    assert unmeasured["full_adaptive_vs_off"] is None and unmeasured["full_best_fixed"] is None
