"""Issue 20's Done-when checks against a served demo family, through the official `openai` client.

    python -m outrider.benchmarks.api_check --size small      # benchmarks/results/api_check_small.md

One local Ray serves one Outrider application per drafting setup, as `outrider serve --demo
SIZE --speculative-config ...` would, and one without speculation, the reference:

    off           --no-speculation
    ngram         co-located (in the target's process)
    draft_model   co-located, the family's draft LM
    eagle3-grpc   the family's eagle3 head in a draft deployment, trees over gRPC

Against `off`, each speculative app must give: the same greedy text, plain and under
penalties + logit_bias; the same greedy logprobs and top_logprobs to 1e-4 (completions whole
and streamed, chat whole); under a json_schema the same greedy output, and 50 of 50 sampled
outputs at T = 1 that parse and validate. The acceptance length under the schema comes from
each app's /metrics (1 + accepted / drafts over the sampled requests). A row fails loudly: the
report says which check and the process exits 1.
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.request
from pathlib import Path

from outrider.benchmarks.bench_structured import SCHEMA
from outrider.benchmarks.report import write_report

PROMPTS = ["def fibonacci(n):\n", "import os\nimport sys\n\n", "class Config:\n    def __init__(self"]
PENALTIES = {"presence_penalty": 0.4, "frequency_penalty": 0.6}
VLLM_PENALTIES = {"repetition_penalty": 1.2, "logit_bias": {"11": -5}}
APPS = {
    "off": {"no_speculation": True},
    "ngram": {"speculative_config": {"method": "ngram", "num_speculative_tokens": 4}},
    "draft_model": {
        "speculative_config": {"method": "draft_model", "num_speculative_tokens": 4, "tree_top_k": 3}
    },
    "eagle3-grpc": {
        "speculative_config": {"method": "eagle3", "num_speculative_tokens": 4, "tree_top_k": 3},
        "draft_pool": {"mode": "deployment", "num_cpus": 0, "round_deadline_ms": 2000},
    },
}
SAMPLED_JSON = 50  # outputs at T = 1 under the schema, per app: 5 requests of n = 10


def deploy(name: str, args: dict, size: str) -> None:
    from ray import serve

    from outrider.cluster.app import build_app

    base = {"demo": size, "engine": {"num_threads": 1}, "target": {"num_cpus": 0}, "ingress_num_cpus": 0}
    serve.run(build_app(base | args), name=name, route_prefix=f"/{name}")


def metric(url: str, name: str) -> float:
    with urllib.request.urlopen(url, timeout=60) as response:
        page = response.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in page.splitlines()
        if line.startswith(name + "{") or line.startswith(name + " ")
    )


def greedy_texts(client, model: str, **extra) -> list[str]:
    body = {k: v for k, v in extra.items() if k in VLLM_PENALTIES}
    kwargs = {k: v for k, v in extra.items() if k not in VLLM_PENALTIES}
    return [
        client.completions.create(
            model=model, prompt=p, max_tokens=48, temperature=0, extra_body=body or None, **kwargs
        )
        .choices[0]
        .text
        for p in PROMPTS
    ]


def logprob_rows(client, model: str) -> dict[str, list[tuple[str, float, dict[str, float]]]]:
    """(token, logprob, top) per output token: completions whole and streamed, chat whole."""
    kwargs = dict(model=model, prompt=PROMPTS[1], max_tokens=24, temperature=0, logprobs=5, **PENALTIES)
    whole = client.completions.create(**kwargs).choices[0].logprobs
    rows = {"completions": list(zip(whole.tokens, whole.token_logprobs, whole.top_logprobs, strict=True))}
    streamed = []
    for chunk in client.completions.create(**kwargs, stream=True):
        if chunk.choices and chunk.choices[0].logprobs:
            lp = chunk.choices[0].logprobs
            streamed += list(zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True))
    rows["completions-stream"] = streamed
    chat = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "def add(a, b):"}],
        max_tokens=16,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        **PENALTIES,
    )
    rows["chat"] = [
        (e.token, e.logprob, {t.token: t.logprob for t in e.top_logprobs})
        for e in chat.choices[0].logprobs.content
    ]
    return rows


def logprob_gap(a: list, b: list) -> float:
    """Largest |difference| of logprobs and top logprobs; inf if the tokens or top sets differ."""
    if [t for t, _, _ in a] != [t for t, _, _ in b] or not a:
        return float("inf")
    gap = 0.0
    for (_, x, top_x), (_, y, top_y) in zip(a, b, strict=True):
        if top_x.keys() != top_y.keys():
            return float("inf")
        gap = max(gap, abs(x - y), *(abs(top_x[k] - top_y[k]) for k in top_x))
    return gap


def json_checks(client, model: str) -> tuple[str, int]:
    """(the greedy output, how many of SAMPLED_JSON outputs at T = 1 parse and validate)."""
    import jsonschema

    messages = [{"role": "user", "content": "A person as JSON:"}]
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    greedy = client.chat.completions.create(
        model=model, messages=messages, response_format=rf, temperature=0, max_tokens=96
    )
    valid = 0
    for seed in range(SAMPLED_JSON // 10):
        answer = client.chat.completions.create(
            model=model,
            messages=messages,
            response_format=rf,
            temperature=1.0,
            seed=seed,
            n=10,
            max_tokens=96,
        )
        for choice in answer.choices:
            try:
                jsonschema.validate(json.loads(choice.message.content), SCHEMA)
                valid += 1
            except (ValueError, jsonschema.ValidationError):
                pass
    return greedy.choices[0].message.content, valid


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="small")
    parser.add_argument("--apps", default=",".join(a for a in APPS if a != "off"))
    parser.add_argument("--results-dir", default=None)
    parser.add_argument(
        "--merge", action="store_true", help="keep the report's rows of apps this run does not check"
    )
    args = parser.parse_args(argv)
    import openai
    import ray
    from ray import serve

    from outrider.benchmarks.report import RESULTS_DIR

    model = f"outrider-demo-{args.size}"  # the name `outrider serve --demo SIZE` serves
    from outrider.cluster.app import set_ray_env

    set_ray_env()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": 8765})
    base = "http://127.0.0.1:8765"
    rows = []
    try:
        deploy("off", APPS["off"], args.size)
        off = openai.OpenAI(base_url=f"{base}/off/v1", api_key="unused", max_retries=0)
        reference = {
            "plain": greedy_texts(off, model),
            "penalties": greedy_texts(off, model, **PENALTIES, **VLLM_PENALTIES),
            "logprobs": logprob_rows(off, model),
            "json": json_checks(off, model)[0],
        }
        for name in args.apps.split(","):
            deploy(name, APPS[name], args.size)
            client = openai.OpenAI(base_url=f"{base}/{name}/v1", api_key="unused", max_retries=0)
            metrics = f"{base}/{name}/metrics"
            row = {
                "app": name,
                "greedy_same": greedy_texts(client, model) == reference["plain"],
                "greedy_same_penalties": greedy_texts(client, model, **PENALTIES, **VLLM_PENALTIES)
                == reference["penalties"],
            }
            ours = logprob_rows(client, model)
            for key, want in reference["logprobs"].items():
                row[f"logprob_gap_{key}"] = logprob_gap(ours[key], want)
            drafts = metric(metrics, "outrider:spec_decode_num_drafts_total")
            accepted = metric(metrics, "outrider:spec_decode_num_accepted_tokens_total")
            greedy_json, valid = json_checks(client, model)
            drafts = metric(metrics, "outrider:spec_decode_num_drafts_total") - drafts
            accepted = metric(metrics, "outrider:spec_decode_num_accepted_tokens_total") - accepted
            row["json_greedy_same"] = greedy_json == reference["json"]
            row["json_valid"] = f"{valid}/{SAMPLED_JSON}"
            row["tau_under_schema"] = 1 + accepted / drafts if drafts else None
            row["drafts_under_schema"] = int(drafts)
            rows.append(row)
            print(json.dumps(row), flush=True)
            serve.delete(name)  # one speculative app at a time beside `off` on 2 cores
    finally:
        serve.shutdown()
        ray.shutdown()
    results_dir = Path(args.results_dir) if args.results_dir else RESULTS_DIR
    earlier = results_dir / f"api_check_{args.size}.json"
    if args.merge and earlier.is_file():
        checked = {row["app"] for row in rows}
        rows = [row for row in json.loads(earlier.read_text())["results"] if row["app"] not in checked] + rows
    failed = [
        (r["app"], k)
        for r in rows
        for k, v in r.items()
        if (k.startswith(("greedy_same", "json_greedy")) and v is not True)
        or (k.startswith("logprob_gap") and not v < 1e-4)
        or (k == "json_valid" and v != f"{SAMPLED_JSON}/{SAMPLED_JSON}")
    ]
    notes = (
        f"Demo family `{args.size}`, one local Ray (2 CPUs), an app per setup beside `off` (no speculation), "
        "queried with the official `openai` client. Greedy: 3 prompts x 48 tokens, plain and with "
        f"{PENALTIES} + {VLLM_PENALTIES} (vLLM's fields in extra_body). Logprob gaps: the largest |difference| "
        "from `off` of every output token's logprob and top logprobs (completions: logprobs=5 with the penalties, "
        "whole and streamed; chat: top_logprobs=3), inf if a token or a top set differs. json_schema: the "
        f"schema of outrider/benchmarks/bench_structured.py; greedy output compared with `off`; {SAMPLED_JSON} outputs at "
        "T = 1 (5 seeds x n = 10) parsed and validated with jsonschema; tau under the schema = 1 + accepted / "
        "drafts over those requests (from the app's /metrics). eagle3-grpc: the family's eagle3 head in a draft "
        "deployment, trees over gRPC. "
        + (
            "Rows of apps this run did not check come from the report's previous run (--merge). "
            if args.merge
            else ""
        )
        + ("Every check passed." if not failed else f"FAILED: {failed}.")
    )
    write_report(
        f"api_check_{args.size}",
        rows,
        {"size": args.size, "argv": sys.argv[1:], "merged": args.merge},
        title="The OpenAI API under speculation: issue 20's checks",
        notes=notes,
        columns=list(dict.fromkeys(k for r in rows for k in r)),
        results_dir=results_dir,
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
