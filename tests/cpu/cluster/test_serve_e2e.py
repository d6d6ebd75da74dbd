"""The real application on local Ray, called with the official `openai` client.

Two apps share one Ray: `spec` (n-gram drafting in the target process) and `off` (plain
decoding, with a tiny batch and queue so overload is reachable). Greedy outputs must be
token-identical between them; /metrics must show the acceptance counters moving; every bad
input gets OpenAI's error shape and status, and the server stays healthy afterwards.
"""

from __future__ import annotations

import concurrent.futures as cf

import pytest
from serve_testlib import MODEL, deploy, get, local_serve, metric, post

pytestmark = pytest.mark.slow  # a local Ray cluster with several replicas: minutes on 2 cores


openai = pytest.importorskip("openai")

PROMPTS = ["def fibonacci(n):\n", "import os\nimport sys\n\n", "class Config:\n    def __init__(self"]


@pytest.fixture(scope="module")
def base_url(tiny_family):
    with local_serve() as url:
        deploy("spec", {"speculative_config": {"method": "ngram", "num_speculative_tokens": 4}}, tiny_family)
        deploy(
            "off",
            {"no_speculation": True, "engine": {"max_num_seqs": 1, "max_queued_requests": 1}},
            tiny_family,
        )
        yield url


def client(base_url: str, app: str):
    return openai.OpenAI(base_url=f"{base_url}/{app}/v1", api_key="unused", max_retries=0)


def test_greedy_completions_equal_speculation_off(base_url):
    spec, off = client(base_url, "spec"), client(base_url, "off")
    for prompt in PROMPTS:
        a = spec.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0)
        b = off.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0)
        assert a.choices[0].text == b.choices[0].text
        assert a.usage.completion_tokens == b.usage.completion_tokens > 0
        assert a.choices[0].finish_reason in ("length", "stop")


def test_stream_equals_whole_and_ends_with_done(base_url):
    spec = client(base_url, "spec")
    whole = spec.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=30, temperature=0)
    chunks = list(
        spec.completions.create(
            model=MODEL,
            prompt=PROMPTS[0],
            max_tokens=30,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    # The raw SSE stream ends with OpenAI's sentinel.
    import urllib.request

    body = b'{"model": "%s", "prompt": "x = 1", "max_tokens": 4, "stream": true}' % MODEL.encode()
    request = urllib.request.Request(
        f"{base_url}/spec/v1/completions", data=body, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        assert response.read().decode().rstrip().endswith("data: [DONE]")


def test_chat_completion_and_stream(base_url):
    spec = client(base_url, "spec")
    messages = [
        {"role": "system", "content": "You write Python."},
        {"role": "user", "content": "def add(a, b):"},
    ]
    whole = spec.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0)
    assert whole.choices[0].message.role == "assistant"
    assert whole.usage.prompt_tokens > 10  # the default template laid the conversation out
    stream = spec.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=20, temperature=0, stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == whole.choices[0].message.content


def test_n_seed_stop_and_sampling(base_url):
    spec = client(base_url, "spec")
    kwargs = dict(model=MODEL, prompt=PROMPTS[1], max_tokens=24, temperature=0.9, top_p=0.95, seed=7, n=2)
    a = spec.completions.create(**kwargs, extra_body={"top_k": 50})
    b = spec.completions.create(**kwargs, extra_body={"top_k": 50})
    assert [c.text for c in a.choices] == [c.text for c in b.choices]  # seeded: reproducible
    assert sorted(c.index for c in a.choices) == [0, 1]
    prompt = "def fib(n):"  # the tiny model continues it with words, not only whitespace
    greedy = spec.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0).choices[0].text
    words = greedy.split()
    assert words, "the greedy output is all whitespace"
    stop = words[min(1, len(words) - 1)][:3]
    cut = spec.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0, stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == greedy[: greedy.index(stop)]


def test_metrics_show_acceptance_counters(base_url):
    status, before = get(f"{base_url}/spec/metrics")
    assert status == 200
    client(base_url, "spec").completions.create(
        model=MODEL, prompt=PROMPTS[2] * 3, max_tokens=40, temperature=0
    )
    _, after = get(f"{base_url}/spec/metrics")
    for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        key = f"outrider:spec_decode_{name}_total"
        assert metric(after, key) >= metric(before, key)
    assert metric(after, "outrider:spec_decode_num_drafts_total") > 0
    assert metric(after, "outrider:spec_decode_num_accepted_tokens_per_pos_total") > 0
    assert metric(after, "outrider:spec_decode_mean_acceptance_length") >= 1.0
    for name in ("time_to_first_token_seconds_count", "inter_token_latency_seconds_count", "batch_occupancy"):
        assert f"outrider:{name}" in after


@pytest.mark.parametrize(
    "body, param",
    [
        (b"{not json", None),
        ({"model": "nope", "prompt": "x"}, "model"),
        ({"model": MODEL, "prompt": "x", "temperature": 3}, "temperature"),
        ({"model": MODEL, "prompt": "x", "top_p": 0}, "top_p"),
        ({"model": MODEL, "prompt": "x", "n": 0}, "n"),
        ({"model": MODEL, "prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"model": MODEL, "prompt": "x", "max_tokens": 1000}, "max_tokens"),
        ({"model": MODEL, "prompt": "def f(x):\n" * 200}, "prompt"),
        ({"model": MODEL, "prompt": [999999]}, "prompt"),
        ({"model": MODEL, "messages": []}, "messages"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(base_url, body, param):
    path = "chat/completions" if isinstance(body, dict) and "messages" in body else "completions"
    status, error = post(f"{base_url}/spec/v1/{path}", body)
    assert status == 400, error
    assert set(error["error"]) == {"message", "type", "param", "code"}
    assert error["error"]["type"] == "invalid_request_error"
    assert error["error"]["param"] == param
    assert get(f"{base_url}/spec/health")[0] == 200


def test_overload_is_a_429_and_the_server_recovers(base_url):
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 80, "temperature": 0}
    with cf.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda _: post(f"{base_url}/off/v1/completions", body), range(8)))
    statuses = sorted(status for status, _ in results)
    assert 200 in statuses and 429 in statuses, statuses
    rejected = next(error for status, error in results if status == 429)
    assert rejected["error"]["code"] == "overloaded"
    assert get(f"{base_url}/off/health")[0] == 200
    assert post(f"{base_url}/off/v1/completions", {**body, "max_tokens": 4})[0] == 200
