"""A TP=2 target (rank 1 a shard actor in the replica's placement group) fed by a separate
draft deployment over gRPC; and target replicas that scale up under load and back down."""

from __future__ import annotations

import threading
import time

import pytest
from serve_testlib import MODEL, deploy, get, local_serve, metric, post

pytestmark = pytest.mark.slow  # a local Ray cluster with several replicas: minutes on 2 cores


PROMPTS = ["def fibonacci(n):\n", "import os\nimport sys\n\n"]


@pytest.fixture(scope="module")
def base_url(tiny_family):
    with local_serve() as url:
        yield url


def _plain_greedy(family, prompt: str, max_tokens: int, **params) -> str:
    """The reference: the engine in this process, no speculation, no Serve."""
    return _plain(family, prompt, max_tokens, **params)[0]


def _plain(family, prompt: str, max_tokens: int, **params) -> tuple[str, list]:
    """The reference's text and each output token's `TokenLogprob` (`params`: more RequestParams)."""
    from outrider.cluster.config import OutriderArgs
    from outrider.cluster.served_model import resolve_model
    from outrider.cluster.text import load_tokenizer
    from outrider.target_worker.engine import Engine
    from outrider.target_worker.runner import ModelRunner
    from outrider.target_worker.sequence import RequestParams

    model = resolve_model(OutriderArgs(demo="tiny"))
    tokenizer = load_tokenizer(model.tokenizer_dir)
    runner = ModelRunner.from_pretrained(
        model.target_dir, max_model_len=model.max_model_len, kv_cache_rows=512
    )
    engine = Engine(runner, None, eos_token_id=model.eos_token_ids)
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    seq_id = engine.add_request(ids, RequestParams(max_tokens=max_tokens, **params))
    tokens, logprobs = [], []
    for out in engine.stream():
        assert out.request_id == seq_id
        tokens += out.new_token_ids
        logprobs += out.logprobs or []
    return tokenizer.decode(tokens, skip_special_tokens=True), logprobs


def test_tp2_target_with_draft_deployment(base_url, tiny_family):
    deploy(
        "tp",
        {
            "tensor_parallel_size": 2,
            "speculative_config": {"method": "ngram", "num_speculative_tokens": 4},
            # A generous deadline: 2 shared cores run the shards, the drafter and this test.
            "draft_pool": {"mode": "deployment", "num_cpus": 0, "round_deadline_ms": 2000},
        },
        tiny_family,
    )
    for prompt in PROMPTS:
        body = {"model": MODEL, "prompt": prompt * 2, "max_tokens": 30, "temperature": 0}
        status, answer = post(f"{base_url}/tp/v1/completions", body)
        assert status == 200, answer
        assert answer["choices"][0]["text"] == _plain_greedy(tiny_family, prompt * 2, 30)
    # Penalties and logprobs through the gRPC drafter and the sharded target (issue 20).
    processors = {"frequency_penalty": 0.8, "repetition_penalty": 1.3}
    body = {"model": MODEL, "prompt": PROMPTS[1] * 2, "max_tokens": 30, "temperature": 0, "logprobs": 2}
    status, answer = post(f"{base_url}/tp/v1/completions", body | processors)
    assert status == 200, answer
    text, entries = _plain(tiny_family, PROMPTS[1] * 2, 30, logprobs=2, **processors)
    logprobs = [e.logprob for e in entries]
    assert answer["choices"][0]["text"] == text
    got = answer["choices"][0]["logprobs"]["token_logprobs"]
    assert len(got) == len(logprobs) and max(abs(a - b) for a, b in zip(got, logprobs, strict=True)) < 1e-4
    page = get(f"{base_url}/tp/metrics")[1]
    assert metric(page, "outrider:spec_decode_num_drafts_total") > 0
    assert metric(page, "outrider:draft_round_trips_total") > 0
    # The draft replica's own counters reach /metrics with its registry announcement (every 2 s).
    assert _wait_for(
        lambda: metric(get(f"{base_url}/tp/metrics")[1], "outrider:spec_cache_lookups_total") > 0, 15
    ), get(f"{base_url}/tp/metrics")[1]  # ngram pre-drafts by default: lookups on every round
    assert metric(get(f"{base_url}/tp/metrics")[1], "outrider:draft_trees_sent_total") > 0
    from ray import serve

    serve.delete("tp")  # frees its three processes for the autoscaling test


def test_eagle3_draft_deployment_with_penalties_and_logprobs(base_url, tiny_family, tokenizer):
    """eagle3 drafting in its own deployment over gRPC (the penalties cross the wire with each
    update), through the official `openai` client: greedy text, logprobs and top_logprobs equal
    plain decoding's to 1e-4, streamed and not."""
    openai = pytest.importorskip("openai")
    deploy(
        "eagle",
        {
            "speculative_config": {"method": "eagle3", "num_speculative_tokens": 4, "tree_top_k": 2},
            "draft_pool": {"mode": "deployment", "num_cpus": 0, "round_deadline_ms": 2000},
        },
        tiny_family,
    )
    client = openai.OpenAI(base_url=f"{base_url}/eagle/v1", api_key="unused", max_retries=0)
    penalties = {"frequency_penalty": 0.6, "presence_penalty": 0.4}
    kwargs = dict(model=MODEL, prompt=PROMPTS[0] * 2, max_tokens=30, temperature=0, logprobs=3, **penalties)
    text, entries = _plain(tiny_family, PROMPTS[0] * 2, 30, logprobs=3, repetition_penalty=1.2, **penalties)
    whole = client.completions.create(**kwargs, extra_body={"repetition_penalty": 1.2}).choices[0]
    streamed = [
        chunk.choices[0]
        for chunk in client.completions.create(**kwargs, extra_body={"repetition_penalty": 1.2}, stream=True)
        if chunk.choices
    ]
    assert whole.text == "".join(c.text for c in streamed) == text
    for scores, tops in (
        (whole.logprobs.token_logprobs, whole.logprobs.top_logprobs),
        (
            [x for c in streamed for x in c.logprobs.token_logprobs],
            [x for c in streamed for x in c.logprobs.top_logprobs],
        ),
    ):
        assert len(scores) == len(entries) > 0
        assert max(abs(a - e.logprob) for a, e in zip(scores, entries, strict=True)) < 1e-4
        for top, e in zip(tops, entries, strict=True):
            want = {tokenizer.decode([t]): lp for t, lp in e.top}
            assert top.keys() == want.keys() and all(abs(top[k] - want[k]) < 1e-4 for k in top)
    page = get(f"{base_url}/eagle/metrics")[1]
    assert metric(page, "outrider:spec_decode_num_accepted_tokens_total") > 0
    assert metric(page, "outrider:draft_round_trips_total") > 0
    from ray import serve

    serve.delete("eagle")


def _running(app: str) -> int:
    from ray import serve

    deployment = serve.status().applications[app].deployments["TargetWorker"]
    return sum(n for state, n in deployment.replica_states.items() if str(state).endswith("RUNNING"))


def _wait_for(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.5)
    return False


def test_target_replicas_scale_up_under_load_and_back_down(base_url, tiny_family):
    fast = {
        "metrics_interval_s": 0.5,
        "look_back_period_s": 1.0,
        "upscale_delay_s": 0.5,
        "downscale_delay_s": 2.0,
    }
    deploy(
        "scale",
        {
            "no_speculation": True,
            "engine": {"max_num_seqs": 1, "max_queued_requests": 16, "num_threads": 1},
            "target": {
                "num_cpus": 0,
                "autoscaling": {"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 1, **fast},
            },
        },
        tiny_family,
    )
    assert _running("scale") == 1
    stop = threading.Event()

    def load() -> None:
        body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 60, "temperature": 0}
        while not stop.is_set():
            post(f"{base_url}/scale/v1/completions", body)

    workers = [threading.Thread(target=load, daemon=True) for _ in range(4)]
    for w in workers:
        w.start()
    try:
        assert _wait_for(lambda: _running("scale") == 2, 90), "no scale-up under load"
    finally:
        stop.set()
        for w in workers:
            w.join(60)
    assert _wait_for(lambda: _running("scale") == 1, 90), "no scale-down once idle"
