"""Serving figures for `outrider bench`: the real Ray Serve application, over HTTP.

Three applications of `cluster.app:build_app`, deployed side by side on one local Ray (route
prefixes `/off`, `/colocated`, `/disaggregated`), each answering OpenAI `/v1/completions`:

    off            no_speculation: plain decoding through the same engine (the baseline)
    colocated      the speculative config in the target replica's process
    disaggregated  the same config in a draft deployment (draft_pool.mode "deployment"),
                   reached over gRPC

At each concurrency c, c client threads send `requests` completions (held-out prompts as
token ids, `max_tokens` each, greedy); throughput = completion tokens / wall time of the
batch, latency = each request's wall time. Variants run interleaved in a shuffled order at
every level, and the whole sweep repeats; figures are medians over repeats and speedups are
ratios against `off` at the same level in the same repeat. Replicas reserve no CPUs
(num_cpus 0) and run one torch thread each, so a 2-core machine holds all three apps; the
target replicas run on the last core, everything else on the others (`pin_target_replicas`).
tau comes from each app's `/metrics` counters (vLLM's names), before and after its batches.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import socket
import statistics
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

VARIANTS = ("off", "colocated", "disaggregated")


def app_args(variant: str, model: dict, spec: dict, max_model_len: int) -> dict:
    """OutriderArgs for one variant; `model` = {"demo": size} or {"model": dir, "tokenizer": dir}."""
    args = {
        **model,
        "engine": {"num_threads": 1, "max_num_seqs": 16, "max_model_len": max_model_len},
        "target": {"num_cpus": 0},
        "draft_pool": {"num_cpus": 0},
        "ingress_num_cpus": 0,
    }
    if variant == "off":
        args["no_speculation"] = True
    else:
        args["speculative_config"] = spec
        if variant == "disaggregated":
            args["draft_pool"]["mode"] = "deployment"
    return args


def start_local_ray(pin: bool = True) -> int:
    """A local Ray for benchmark apps (2 CPUs, one torch thread per process); returns a free
    port for Serve's HTTP proxy. `pin`: this process, and so every Ray process it starts, runs
    on all cores but the last, which `pin_target_replicas` gives to the target replicas."""
    import ray

    from outrider.cluster.app import set_ray_env

    if pin and _serving_cores() is not None:
        _pin_process(os.getpid(), _serving_cores())
    set_ray_env()
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}},
    )
    return _free_port()


# The cores this process could use when it started (before `start_local_ray` narrowed them).
_CORES = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []


def _serving_cores() -> set[int] | None:
    """Every core this process started with but the last; None where affinity cannot be set
    (not Linux) or there is one core."""
    return set(_CORES[:-1]) if len(_CORES) > 1 else None


def _pin_process(pid: int, cores: set[int]) -> None:
    """Every thread of `pid` on `cores` (affinity is per thread; new threads inherit it)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError):  # the thread ended meanwhile
            os.sched_setaffinity(int(tid), cores)


def unpin() -> None:
    """This process back on every core it started with (after `start_local_ray(pin=True)`)."""
    if _serving_cores() is not None:
        _pin_process(os.getpid(), set(_CORES))


def pin_target_replicas(active: str) -> int:
    """The target replicas of application `active` onto the last core, alone, and every other
    application's onto the others (started by `start_local_ray(pin=True)`, with the proxy, the
    ingresses, draft replicas and the load generator): the step thread of the target being
    measured gets a core of its own, as a target gets its own accelerator, and idle replicas'
    housekeeping (Ray's polls, health checks) does not interrupt it. On 2 cores, with every
    process free to move, one application's throughput at concurrency 1 drifted by up to 10%
    from one deployment of it to the next (a 3% question cannot be asked of that); pinned, an
    application beside itself measured 0.993x and 1.000x. Call before each application's
    block; returns how many processes were moved to the last core."""
    serving = _serving_cores()
    if serving is None:
        return 0
    mine = f"ray::ServeReplica:{active}:TargetWorker".encode()
    pinned = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                title = f.read().split(b"\0", 1)[0]
            # While busy, Ray's title names the method too (`...:TargetWorker.handle_request_with_
            # rejection`): matched on the whole title, a replica still answering its last block's
            # /metrics scrape would keep the measured one's core through the next block.
            name, worker, _ = title.partition(b":TargetWorker")
            if name.startswith(b"ray::ServeReplica:") and worker:
                alone = name + worker == mine
                _pin_process(int(pid), {_CORES[-1]} if alone else serving)
                pinned += alone
        except OSError:  # the process ended meanwhile
            continue
    return pinned


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict) -> dict:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=600) as response:
        return json.loads(response.read())


def _spec_counters(base: str) -> tuple[float, float]:
    """(drafts, accepted tokens) summed over an app's `/metrics` page."""
    with urllib.request.urlopen(f"{base}/metrics", timeout=60) as response:
        page = response.read().decode()
    totals = {
        "outrider:spec_decode_num_drafts_total": 0.0,
        "outrider:spec_decode_num_accepted_tokens_total": 0.0,
    }
    for line in page.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in totals:
            totals[name] += float(line.rsplit(" ", 1)[1])
    return tuple(totals.values())


def run_load(
    base: str, model_name: str, prompts: list[list[int]], concurrency: int, requests: int, max_tokens: int
) -> dict:
    """`requests` completions from `concurrency` client threads; throughput and latencies."""
    bodies = [
        {"model": model_name, "prompt": prompts[i % len(prompts)], "max_tokens": max_tokens, "temperature": 0}
        for i in range(requests)
    ]

    def one(body: dict) -> tuple[float, int]:
        started = time.perf_counter()
        reply = _post(f"{base}/v1/completions", body)
        return time.perf_counter() - started, int(reply["usage"]["completion_tokens"])

    started = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        done = list(pool.map(one, bodies))
    wall = time.perf_counter() - started
    return {"wall_s": wall, "latencies": [d[0] for d in done], "tokens": sum(d[1] for d in done)}


def bench_serving(
    model: dict,
    model_name: str,
    spec: dict,
    prompts: list[list[int]],
    *,
    concurrencies: list[int],
    max_tokens: int,
    max_model_len: int,
    repeats: int,
    requests_per_level: int,
    seed: int = 0,
    log=print,
) -> list[dict]:
    """Rows: one per (variant, concurrency); see the module docstring."""
    import ray
    from ray import serve

    from outrider.cluster.app import build_app

    port = start_local_ray()
    samples: dict[tuple[str, int], list[dict]] = {}
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        started = time.perf_counter()
        for variant in VARIANTS:
            serve.run(
                build_app(app_args(variant, model, spec, max_model_len)),
                name=variant,
                route_prefix=f"/{variant}",
            )
        log(f"serving: three apps up in {time.perf_counter() - started:.0f} s")
        for variant in VARIANTS:  # warm-up: first requests pay for lazy initialisation
            run_load(f"http://127.0.0.1:{port}/{variant}", model_name, prompts, 1, 1, 8)
        rng = random.Random(seed)
        for repeat in range(repeats):
            for concurrency in concurrencies:
                order = list(VARIANTS)
                rng.shuffle(order)
                for variant in order:
                    base = f"http://127.0.0.1:{port}/{variant}"
                    pin_target_replicas(variant)
                    before = _spec_counters(base)
                    n = max(requests_per_level, concurrency)
                    sample = run_load(base, model_name, prompts, concurrency, n, max_tokens)
                    after = _spec_counters(base)
                    sample["drafts"], sample["accepted"] = after[0] - before[0], after[1] - before[1]
                    samples.setdefault((variant, concurrency), []).append(sample)
                    log(
                        f"serving repeat {repeat} c={concurrency} {variant}: "
                        f"{sample['tokens'] / sample['wall_s']:.0f} tok/s"
                    )
    finally:
        serve.shutdown()
        ray.shutdown()
        unpin()
    return _rows(samples, repeats)


def _rows(samples: dict[tuple[str, int], list[dict]], repeats: int) -> list[dict]:
    rows = []
    for (variant, concurrency), runs in samples.items():
        off = samples[("off", concurrency)]
        throughput = [r["tokens"] / r["wall_s"] for r in runs]
        latencies = sorted(lat for r in runs for lat in r["latencies"])
        drafts, accepted = sum(r["drafts"] for r in runs), sum(r["accepted"] for r in runs)
        rows.append(
            {
                "variant": variant,
                "concurrency": concurrency,
                "requests": sum(len(r["latencies"]) for r in runs),
                "throughput_tokens_per_s": statistics.median(throughput),
                "speedup_vs_off": statistics.median(
                    t / (o["tokens"] / o["wall_s"]) for t, o in zip(throughput, off, strict=True)
                ),
                "latency_p50_s": statistics.median(latencies),
                "latency_p90_s": latencies[min(len(latencies) - 1, int(0.9 * len(latencies)))],
                "acceptance_length": 1 + accepted / drafts if drafts else None,
                "repeats": repeats,
            }
        )
    order = {v: i for i, v in enumerate(VARIANTS)}
    return sorted(rows, key=lambda r: (r["concurrency"], order[r["variant"]]))
