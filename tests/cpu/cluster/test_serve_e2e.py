"""The real application on local Ray, called with the official `openai` client.

Two apps share one Ray: `spec` (n-gram drafting in the target process) and `off` (plain
decoding, with a tiny batch and queue so overload is reachable). Greedy outputs must be
token-identical between them; /metrics must show the acceptance counters moving; every bad
input gets OpenAI's error shape and status, and the server stays healthy afterwards.
"""

from __future__ import annotations

import concurrent.futures as cf
import itertools

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


def test_continuous_usage_stats_count_the_tokens_each_chunk_brings(base_url):
    """vLLM's `continuous_usage_stats` (with `include_usage`): every chunk carries the usage so
    far; drafts kept, a chunk brings several tokens at once, and the counts sum to the whole."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    for app in ("spec", "off"):
        chunks = list(
            client(base_url, app).completions.create(
                model=MODEL,
                prompt=PROMPTS[1],
                max_tokens=40,
                temperature=0,
                stream=True,
                stream_options=options,
            )
        )
        counts = [c.usage.completion_tokens for c in chunks]
        assert all(c.usage is not None for c in chunks) and counts == sorted(counts)
        assert counts[-1] == counts[-2] == 40 and chunks[-1].usage.prompt_tokens > 0
        if app == "spec":
            assert max(b - a for a, b in itertools.pairwise(counts)) > 1  # a round kept drafts
    plain = client(base_url, "spec").completions.create(  # include_usage alone: the last chunk only
        model=MODEL, prompt=PROMPTS[1], max_tokens=8, stream=True, stream_options={"include_usage": True}
    )
    assert [c.usage is not None for c in plain][-2:] == [False, True]


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


# ------------------------------------------------------------------------------ the sampling surface
# Logprobs, penalties, the vLLM sampling extensions and structured output, speculation on
# against off (issue 20). The engine-level tests cover them in depth; these check that each
# field crosses the wire, in both endpoints' shapes, streamed and not.

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
PROCESSORS = {"frequency_penalty": 0.7, "presence_penalty": 0.3}
VLLM_PROCESSORS = {"repetition_penalty": 1.3, "min_p": 0.05, "logit_bias": {"5": 2.0}}


def _completion_logprobs(c, stream: bool):
    kwargs = dict(model=MODEL, prompt=PROMPTS[1], max_tokens=24, temperature=0, logprobs=5, **PROCESSORS)
    if not stream:
        lp = c.completions.create(**kwargs, extra_body=VLLM_PROCESSORS).choices[0].logprobs
        return lp.tokens, lp.token_logprobs, lp.top_logprobs
    tokens, scores, tops = [], [], []
    for chunk in c.completions.create(**kwargs, extra_body=VLLM_PROCESSORS, stream=True):
        if chunk.choices and chunk.choices[0].logprobs:
            tokens += chunk.choices[0].logprobs.tokens
            scores += chunk.choices[0].logprobs.token_logprobs
            tops += chunk.choices[0].logprobs.top_logprobs
    return tokens, scores, tops


def _chat_logprobs(c, stream: bool):
    kwargs = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "def add(a, b):"}],
        max_tokens=16,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        **PROCESSORS,
    )
    if not stream:
        return c.chat.completions.create(**kwargs).choices[0].logprobs.content
    return [
        entry
        for chunk in c.chat.completions.create(**kwargs, stream=True)
        if chunk.choices and chunk.choices[0].logprobs
        for entry in chunk.choices[0].logprobs.content
    ]


def test_greedy_logprobs_equal_speculation_off_streamed_and_not(base_url):
    spec, off = client(base_url, "spec"), client(base_url, "off")
    for stream in (False, True):
        a, b = _completion_logprobs(spec, stream), _completion_logprobs(off, stream)
        assert a[0] == b[0] and len(a[0]) == 24
        assert max(abs(x - y) for x, y in zip(a[1], b[1], strict=True)) < 1e-4
        for top_a, top_b in zip(a[2], b[2], strict=True):
            assert top_a.keys() == top_b.keys() and all(abs(top_a[k] - top_b[k]) < 1e-4 for k in top_a)
        a, b = _chat_logprobs(spec, stream), _chat_logprobs(off, stream)
        assert [e.token for e in a] == [e.token for e in b] and len(a) > 0
        for x, y in zip(a, b, strict=True):
            assert abs(x.logprob - y.logprob) < 1e-4 and len(x.top_logprobs) == 3
            assert [t.token for t in x.top_logprobs] == [t.token for t in y.top_logprobs]
            assert (
                max(abs(s.logprob - t.logprob) for s, t in zip(x.top_logprobs, y.top_logprobs, strict=True))
                < 1e-4
            )
    # echo: the prompt's tokens first, the first with no logprob, then the output's.
    echo = [
        c.completions.create(
            model=MODEL, prompt=PROMPTS[2], max_tokens=8, temperature=0, logprobs=2, echo=True
        )
        for c in (spec, off)
    ]
    lp = [e.choices[0].logprobs for e in echo]
    assert lp[0].tokens == lp[1].tokens and "".join(lp[0].tokens) == echo[0].choices[0].text
    assert lp[0].token_logprobs[0] is None and lp[0].top_logprobs[0] is None
    assert (
        max(abs(x - y) for x, y in zip(lp[0].token_logprobs[1:], lp[1].token_logprobs[1:], strict=True))
        < 1e-4
    )
    assert lp[0].text_offset[-1] == len(echo[0].choices[0].text) - len(lp[0].tokens[-1])
    whole, streamed = _completion_logprobs(spec, False), _completion_logprobs(spec, True)
    assert (
        whole[0] == streamed[0] and max(abs(x - y) for x, y in zip(whole[1], streamed[1], strict=True)) < 1e-4
    )


def test_structured_output_validates_and_greedy_equals_speculation_off(base_url):
    import json

    jsonschema = pytest.importorskip("jsonschema")
    spec, off = client(base_url, "spec"), client(base_url, "off")
    messages = [{"role": "user", "content": "A person as JSON:"}]
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    sampled = spec.chat.completions.create(
        model=MODEL, messages=messages, response_format=rf, n=5, temperature=1.0, seed=3, max_tokens=90
    )
    for choice in sampled.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), PERSON)
    for extra in ({"response_format": rf}, {"extra_body": {"structured_outputs": {"choice": ["yes", "no"]}}}):
        a, b = (
            c.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=90, **extra)
            for c in (spec, off)
        )
        assert a.choices[0].message.content == b.choices[0].message.content
    assert b.choices[0].message.content in ("yes", "no")
    regex = spec.completions.create(
        model=MODEL,
        prompt="x = ",
        max_tokens=20,
        temperature=0,
        extra_body={"structured_outputs": {"regex": "[0-9]{3}"}},
    )
    assert regex.choices[0].text.isdigit() and len(regex.choices[0].text) == 3


def test_each_of_n_seeded_choices_is_reproducible_alone(base_url):
    """Choice i of a request with seed s is the request with seed s + i and n = 1."""
    spec = client(base_url, "spec")
    kwargs = dict(model=MODEL, prompt=PROMPTS[1], max_tokens=12, temperature=1.0, presence_penalty=0.5)
    both = spec.completions.create(**kwargs, n=2, seed=40).choices
    alone = spec.completions.create(**kwargs, n=1, seed=41).choices[0]
    assert sorted(both, key=lambda c: c.index)[1].text == alone.text


def test_stop_token_ids_min_tokens_and_logit_bias_reach_the_engine(base_url):
    """logit_bias +100 makes token 7 the only choice; as a stop id it ends the output at once,
    unless min_tokens masks it: then exactly min_tokens other tokens come first."""
    spec = client(base_url, "spec")
    kwargs = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=30, temperature=0)
    forced = {"logit_bias": {"7": 100}}
    assert spec.completions.create(**kwargs, logit_bias={"7": 100}).usage.completion_tokens == 30
    cut = spec.completions.create(**kwargs, extra_body=forced | {"stop_token_ids": [7]})
    assert cut.choices[0].finish_reason == "stop" and cut.usage.completion_tokens == 0
    late = spec.completions.create(**kwargs, extra_body=forced | {"stop_token_ids": [7], "min_tokens": 5})
    assert late.choices[0].finish_reason == "stop" and late.usage.completion_tokens == 5


@pytest.mark.parametrize(
    "body, param",
    [
        ({"best_of": 2}, "best_of"),
        ({"suffix": "x"}, "suffix"),
        ({"temprature": 0.5}, "temprature"),
        ({"logit_bias": {"999999": 1}}, "logit_bias"),
        ({"stop_token_ids": [999999]}, "stop_token_ids"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 5}}}},
            "response_format",
        ),
        ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),  # as vLLM: not with stream
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
        (
            {"stream": True, "stream_options": {"include_usage": True, "usage_every": 1}},
            "stream_options.usage_every",
        ),
        ({"stream": True, "stream_options": {"include_usage": "often"}}, "stream_options.include_usage"),
    ],
)
def test_unimplemented_or_bad_fields_are_refused_not_ignored(base_url, body, param):
    status, error = post(
        f"{base_url}/spec/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2} | body
    )
    assert status == 400 and error["error"]["param"] == param, error
    accepted = {"best_of": 1, "suffix": None, "user": "u", "metadata": {"k": "v"}, "logprobs": None}
    assert (
        post(f"{base_url}/spec/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2} | accepted)[
            0
        ]
        == 200
    )


def test_prompt_logprobs_as_vllm(base_url, tokenizer):
    """vLLM's `prompt_logprobs`: per choice, None for the first prompt token, then the token's own
    {logprob, rank, decoded_token} and the top N; equal with speculation on and off and to echo's."""
    spec, off = client(base_url, "spec"), client(base_url, "off")
    ids = tokenizer.encode(PROMPTS[2], add_special_tokens=False)
    kwargs = dict(model=MODEL, prompt=ids, max_tokens=3, temperature=0)
    a, b = (c.completions.create(**kwargs, extra_body={"prompt_logprobs": 2}).choices[0] for c in (spec, off))
    pa, pb = a.to_dict()["prompt_logprobs"], b.to_dict()["prompt_logprobs"]
    assert len(pa) == len(ids) and pa[0] is None and pb[0] is None
    echo = spec.completions.create(**kwargs, logprobs=1, echo=True).choices[0].logprobs.token_logprobs
    for i in range(1, len(ids)):
        own = pa[i][str(ids[i])]
        assert own["decoded_token"] == tokenizer.decode([ids[i]]) and abs(own["logprob"] - echo[i]) < 1e-5
        ranked = sorted(pa[i].values(), key=lambda e: e["rank"])
        assert [e["rank"] for e in ranked[:2]] == [1, 2] and ranked[0]["logprob"] >= ranked[1]["logprob"]
        assert own["rank"] <= 2 if len(pa[i]) == 2 else own["rank"] > 2 and len(pa[i]) == 3
        assert pa[i].keys() == pb[i].keys()
        assert all(abs(pa[i][k]["logprob"] - pb[i][k]["logprob"]) < 1e-4 for k in pa[i])
    assert "prompt_logprobs" not in spec.completions.create(**kwargs).choices[0].to_dict()
    # Chat: at the top of the response (vLLM's place), over the templated prompt.
    chat = dict(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2, temperature=0)
    a, b = (c.chat.completions.create(**chat, extra_body={"prompt_logprobs": 1}) for c in (spec, off))
    pa, pb = a.to_dict()["prompt_logprobs"], b.to_dict()["prompt_logprobs"]
    assert len(pa) == a.usage.prompt_tokens and pa[0] is None and all(len(e) in (1, 2) for e in pa[1:])
    assert [e.keys() for e in pa[1:]] == [e.keys() for e in pb[1:]]
    assert "prompt_logprobs" not in a.choices[0].to_dict()
    status, error = post(
        f"{base_url}/spec/v1/chat/completions", chat | {"prompt_logprobs": 1, "stream": True}
    )
    assert status == 400 and error["error"]["param"] == "prompt_logprobs", error
