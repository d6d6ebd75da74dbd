"""The bounded load generator and the autoscaling / soak reports, against a stub HTTP server.

The stub answers `/v1/completions` like the ingress (whole JSON, or SSE ending in [DONE]); the
generator must stop by itself when its phases end, record every request, flag a wrong greedy
answer, and refuse any host but the loopback.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from outrider.benchmarks.autoscale_report import scale_up_times, write_autoscale, write_soak
from outrider.benchmarks.loadgen import LoadGenerator, LoadMix, Phase, percentile


class Stub(BaseHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass

    bodies: list[dict] = []  # every request body received

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        Stub.bodies.append(body)
        text = "ok " * 3 if body["prompt"] != "wrong" else "nope"
        self.send_response(200)
        if body.get("stream"):
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            every = (body.get("stream_options") or {}).get("continuous_usage_stats")
            for i, word in enumerate(text.split(" ")):
                event = {"choices": [{"index": 0, "text": word + " "}]}
                if every:  # vLLM's usage in every chunk
                    event["usage"] = {"completion_tokens": min(i + 1, 3)}
                self.wfile.write(f"data: {json.dumps(event)}\n\n".encode())
            usage = {"choices": [], "usage": {"completion_tokens": 3}}
            self.wfile.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
            return
        answer = {"choices": [{"text": text}], "usage": {"completion_tokens": 3}}
        payload = json.dumps(answer).encode()
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)


@pytest.fixture(scope="module")
def stub_url():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Stub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/app"
    server.shutdown()


def test_only_the_loopback_is_driven():
    with pytest.raises(ValueError, match="this machine"):
        LoadGenerator("http://example.com:8000/app", "m", ["x"], 4)


def test_ignore_eos_is_asked_for_only_when_set(stub_url):
    for ignore in (False, True):
        Stub.bodies.clear()
        generator = LoadGenerator(stub_url, "m", [], 3, ignore_eos=ignore)
        assert generator.request("x", stream=True, greedy=False).ok
        assert Stub.bodies[-1].get("ignore_eos", False) is ignore


def test_a_bounded_run_records_every_request_and_checks_greedy_answers(stub_url, tmp_path):
    reference = {"fine": "ok ok ok ", "wrong": "ok ok ok "}
    generator = LoadGenerator(
        stub_url, "m", ["fine", "wrong"], 3, LoadMix(stream_share=0.5, disconnect_share=0.2), reference
    )
    starts = []
    began = time.monotonic()
    records = generator.run([Phase(0.4, 1), Phase(0.4, 3), Phase(0.2, 0)], lambda i, p, t: starts.append(t))
    assert time.monotonic() - began < 5  # it stopped by itself
    assert len(starts) == 3 and records and all(r.ok for r in records)
    assert {r.kind for r in records} <= {"stream", "whole", "disconnect"}
    checked = [r for r in records if r.kind != "disconnect"]
    assert any(r.wrong for r in checked) and not all(r.wrong for r in checked)
    samples = [
        {
            "t": float(t),
            "target_replicas": 1 + (t >= 0.6),
            "draft_replicas": 1,
            "target_starting": int(t == 0.5),
            "draft_starting": 0,
            "running": 1.0,
            "waiting": 0.0,
            "draft_busy": 0.1,
        }
        for t in (0.1, 0.3, 0.5, 0.6, 0.9)
    ]
    phases = [Phase(0.4, 1), Phase(0.4, 3), Phase(0.2, 0)]
    paths = write_autoscale(
        tmp_path, {"machine": {"cpu_count": 2, "date": "d"}, "setup_s": 1.0}, phases, starts, records, samples
    )
    assert all(p.exists() for p in paths)
    summary = json.loads(paths[0].read_text())["summary"]
    assert summary["requests"] == len(records) and summary["failed"] == 0
    paths = write_soak(
        tmp_path,
        {"machine": {"cpu_count": 2, "date": "d"}},
        1,
        records,
        samples,
        {"proc": [(0.0, 100 << 20), (50.0, 101 << 20)]},
        [{"t": 1.0, "killed": "TargetWorker"}],
    )
    soak = json.loads(paths[0].read_text())
    assert soak["summary"]["sent"] == len(records) and soak["memory"][0]["growth_mb"] == 1.0


def test_scale_up_times_and_percentiles():
    samples = [
        {"t": 0.0, "target_replicas": 1, "target_starting": 0},
        {"t": 5.0, "target_replicas": 1, "target_starting": 2},
        {"t": 9.0, "target_replicas": 2, "target_starting": 1},
        {"t": 12.0, "target_replicas": 3, "target_starting": 0},
    ]
    times = scale_up_times(samples, "target", load_start=2.0, load_end=20.0)
    assert times == {
        "replicas_before": 1,
        "first_started_s": 3.0,
        "first_added_s": 7.0,
        "peak": 3,
        "peak_reached_s": 10.0,
    }
    assert percentile([], 0.5) is None and percentile([3.0, 1.0, 2.0], 0.5) == 2.0


def test_streamed_requests_record_when_each_token_arrived(stub_url):
    """The usage every chunk carries (vLLM's `continuous_usage_stats`, asked for with
    `include_usage`) gives each chunk's arrival and the tokens by then: what the HTTP sweep's
    full-concurrency rate counts."""
    generator = LoadGenerator(stub_url, "m", [], 3)
    Stub.bodies.clear()
    record = generator.request("x", stream=True, greedy=True)
    assert Stub.bodies[-1]["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    times = [t for t, _ in record.token_times]
    assert [n for _, n in record.token_times] == [1, 2, 3, 3, 3] and times == sorted(times)
    assert record.start <= times[0] and record.tokens == 3
