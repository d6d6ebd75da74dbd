"""Both pools autoscaling under load, then a soak with replicas killed: on one machine.

    python -m outrider.benchmarks.bench_autoscale                 # ~4 min autoscaling + 5 min soak
    python -m outrider.benchmarks.bench_autoscale --soak-minutes 0 --load-s 60

A five-node local Ray cluster (`ray.cluster_utils.Cluster`: a head, two "large GPU" nodes
with `outrider_target_gpu`, two "small GPU" nodes with `outrider_draft_gpu`; the GPUs are
declared, the models run on the CPU) serves the tiny demo family with a draft deployment
(`draft_model`: the demo's draft LM, so drafting costs real time). Both deployments
autoscale: targets on requests in flight, drafters on their busy share (`DraftLoadPolicy`).

1. **Autoscaling**: `benchmarks.loadgen` drives a step (1 client, then `--concurrency`, then
   1 again, then none); a sampler records every second the replicas of both deployments,
   the queue (running / waiting sequences as /metrics reports them) and the drafters' busy
   share. Report: replicas over time for both pools (a plot), tokens/s, TTFT, and how long
   each scale-up took after the load step.
2. **Soak**: mixed load (streams and whole, greedy and sampled, long prompts, clients that
   hang up) for `--soak-minutes`, killing a target or a draft replica (alternately) every
   `--kill-every-s`. Report: requests sent / completed / failed, wrong answers at T = 0,
   p50 / p99 latency per minute, and the memory (RSS) of every Ray actor process at its first
   and last sample.

Reports: `results/autoscale_tiny.{json,md,png}` and `results/soak_tiny.{json,md}`. Requests
go to 127.0.0.1 only, and the run stops by itself.
"""

from __future__ import annotations

import argparse
import json
import socket
import threading
import time
import urllib.request
from pathlib import Path

from outrider.benchmarks.autoscale_report import write_autoscale, write_soak
from outrider.benchmarks.loadgen import LoadGenerator, LoadMix, Phase
from outrider.benchmarks.report import RESULTS_DIR, environment

MODEL = "outrider-demo-tiny"
APP = "scale"
PROMPTS = [
    "class Config:\n    def __init__(self",
    "        self.assertEqual(",
    "def main():\n    parser = argparse",
    "    return self.",
    "from typing import",
    "    raise ValueError(",
]
DEPLOYMENTS = ("TargetWorker", "DraftWorker")


def app_args(max_replicas: int) -> dict:
    scaling = {
        "min_replicas": 1,
        "max_replicas": max_replicas,
        "metrics_interval_s": 1.0,
        "look_back_period_s": 5.0,
        "upscale_delay_s": 3.0,
        "downscale_delay_s": 30.0,
    }
    return {
        "demo": "tiny",
        "speculative_config": {"method": "draft_model", "num_speculative_tokens": 3},
        "engine": {"num_threads": 1, "max_num_seqs": 4, "max_queued_requests": 64},
        "target": {
            "num_cpus": 0,
            "gpus_per_rank": 0.5,
            "autoscaling": {**scaling, "target_ongoing_requests": 3},
        },
        "draft_pool": {
            "mode": "deployment",
            "num_cpus": 0,
            "gpus_per_replica": 0.5,
            "round_deadline_ms": 500,
            # The tiny drafter is cheap (2-8 % of a core in all at full load on this machine):
            # a low target share lets this demo's load cross it. Default: 0.6.
            "target_busy_fraction": 0.02,
            "autoscaling": scaling,
        },
        "ingress_num_cpus": 0,
    }


def start_cluster():
    import ray
    from ray.cluster_utils import Cluster

    from outrider.cluster.app import set_ray_env
    from outrider.cluster.gpu_pools import DRAFT_RESOURCE, TARGET_RESOURCE

    set_ray_env()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": True})
    for _ in range(2):
        cluster.add_node(num_cpus=1, num_gpus=2, resources={TARGET_RESOURCE: 2})
    for _ in range(2):
        cluster.add_node(num_cpus=1, num_gpus=2, resources={DRAFT_RESOURCE: 2})
    ray.init(address=cluster.address, log_to_driver=False)
    cluster.wait_for_nodes()
    return cluster


class Sampler:
    """Every `period_s`: replicas per deployment, queue gauges, drafters' busy share; RSS every 10th."""

    def __init__(self, base_url: str, ray_address: str, period_s: float = 1.0):
        self.base_url, self.ray_address, self.period_s = base_url, ray_address, period_s
        self.samples: list[dict] = []
        self.memory: dict[str, list[tuple[float, int]]] = {}  # process -> [(t, rss bytes)]
        self._stop = threading.Event()
        self._t0 = time.monotonic()
        self._drafting: dict[str, list[tuple[float, float]]] = {}  # draft replica -> [(t, drafting_s)]
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self, t0: float) -> None:
        self._t0 = t0
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)

    def _run(self) -> None:
        tick = 0
        while not self._stop.wait(self.period_s):
            try:
                self.samples.append(self.sample())
                if tick % 10 == 0:
                    self.sample_memory()
            except Exception as error:  # a sample lost to a restart in progress is only a gap
                print(f"sampler: {type(error).__name__}: {error}")
            tick += 1

    def sample(self) -> dict:
        from ray import serve

        from outrider.cluster.draft_registry import draft_announcements

        now = time.monotonic() - self._t0
        deployments = serve.status().applications[APP].deployments

        def count(name: str, state: str) -> int:
            return sum(n for s, n in deployments[name].replica_states.items() if state in str(s))

        replicas = {name: count(name, "RUNNING") for name in DEPLOYMENTS}
        starting = {name: count(name, "STARTING") for name in DEPLOYMENTS}
        with urllib.request.urlopen(f"{self.base_url}/metrics", timeout=10) as response:
            page = response.read().decode()
        busy = 0.0  # drafting seconds per second over the last ~5 s (announcements come every 2 s)
        for announcement in draft_announcements(APP):
            history = self._drafting.setdefault(announcement.replica, [])
            history.append((now, announcement.drafting_s))
            while len(history) > 1 and now - history[1][0] >= 5.0:
                history.pop(0)
            (t, drafting) = history[0]
            if now - t >= 2.0:
                busy += (announcement.drafting_s - drafting) / (now - t)
        return {
            "t": round(now, 2),
            "target_replicas": replicas["TargetWorker"],
            "draft_replicas": replicas["DraftWorker"],
            "target_starting": starting["TargetWorker"],
            "draft_starting": starting["DraftWorker"],
            "running": gauge(page, "outrider:num_requests_running"),
            "waiting": gauge(page, "outrider:num_requests_waiting"),
            "draft_busy": round(busy, 3),
        }

    def sample_memory(self) -> None:
        from ray.util.state import list_actors

        now = time.monotonic() - self._t0
        for actor in list_actors(address=self.ray_address, filters=[("state", "=", "ALIVE")], limit=1000):
            rss = read_rss(actor.pid)
            if rss is not None:
                key = f"{actor.class_name} {actor.name or actor.actor_id[:8]} pid {actor.pid}"
                self.memory.setdefault(key, []).append((round(now, 1), rss))


def counter(base_url: str, name: str) -> float:
    """One counter of the application's /metrics page, now."""
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=30) as response:
        page = response.read().decode()
    return gauge(page, name)


def gauge(page: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in page.splitlines() if line.startswith(name + "{"))


def read_rss(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def reference_answers(base_url: str) -> dict[str, str]:
    """Each prompt's greedy answer at concurrency 1, nothing killed: what every later one must equal."""
    answers = {}
    for prompt in PROMPTS + [p * 4 for p in PROMPTS]:  # the long prompts too
        body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 48, "temperature": 0}).encode()
        request = urllib.request.Request(
            f"{base_url}/v1/completions", data=body, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=120) as response:
            answers[prompt] = json.loads(response.read())["choices"][0]["text"]
    return answers


def killer(stop: threading.Event, every_s: float, log: list, t0: float, ray_address: str) -> None:
    """Kill a target replica, then a draft replica, ... every `every_s` until `stop`."""
    import ray
    from ray.util.state import list_actors

    turn = 0
    while not stop.wait(every_s):
        deployment = DEPLOYMENTS[turn % 2]
        turn += 1
        alive = list_actors(
            address=ray_address,
            filters=[("class_name", "=", f"ServeReplica:{APP}:{deployment}"), ("state", "=", "ALIVE")],
        )
        if not alive:
            continue
        victim = alive[0]
        ray.kill(ray.get_actor(victim.name, namespace="serve"), no_restart=True)
        log.append({"t": round(time.monotonic() - t0, 1), "killed": deployment, "replica": victim.name})
        print(f"soak: killed {victim.name}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, default=12, help="clients during the load step")
    parser.add_argument("--load-s", type=float, default=100.0, help="length of the load step")
    parser.add_argument("--max-replicas", type=int, default=3, help="per deployment")
    parser.add_argument("--soak-minutes", type=float, default=5.0, help="0 = no soak")
    parser.add_argument("--soak-concurrency", type=int, default=6)
    parser.add_argument("--kill-every-s", type=float, default=60.0)
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)

    import os

    from ray import serve

    from outrider.cluster.app import build_app

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    began = time.monotonic()
    cluster = start_cluster()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port}, proxy_location="HeadOnly")
        serve.run(build_app(app_args(args.max_replicas)), name=APP, route_prefix=f"/{APP}")
        base_url = f"http://127.0.0.1:{port}/{APP}"
        reference = reference_answers(base_url)
        setup_s = time.monotonic() - began

        phases = [Phase(15, 1), Phase(args.load_s, args.concurrency), Phase(60, 1), Phase(45, 0)]
        generator = LoadGenerator(base_url, MODEL, PROMPTS, max_tokens=48, reference=reference)
        sampler = Sampler(base_url, cluster.address)
        sampler.start(time.monotonic())
        phase_starts: list[float] = []
        records = generator.run(phases, on_phase=lambda i, p, t: phase_starts.append(round(t, 2)))
        sampler.stop()
        meta = {"machine": environment(), "setup_s": round(setup_s, 1), "args": app_args(args.max_replicas)}
        write_autoscale(args.out, meta, phases, phase_starts, records, sampler.samples)

        if args.soak_minutes > 0:
            mix = LoadMix(stream_share=0.5, sampled_share=0.25, long_prompt_share=0.2, disconnect_share=0.1)
            soak = LoadGenerator(
                base_url, MODEL, PROMPTS, max_tokens=48, mix=mix, reference=reference, seed=1
            )
            sampler = Sampler(base_url, cluster.address)
            t0 = time.monotonic()
            sampler.start(t0)
            resumed_before = counter(base_url, "outrider:request_resumes_total")
            stop, kills = threading.Event(), []
            threading.Thread(
                target=killer, args=(stop, args.kill_every_s, kills, t0, cluster.address), daemon=True
            ).start()
            records = soak.run([Phase(60 * args.soak_minutes, args.soak_concurrency)])
            stop.set()
            sampler.stop()
            resumes = counter(base_url, "outrider:request_resumes_total") - resumed_before
            write_soak(
                args.out, meta, args.soak_minutes, records, sampler.samples, sampler.memory, kills, resumes
            )
        print(f"done in {time.monotonic() - began:.0f} s")
    finally:
        serve.shutdown()
        import ray

        ray.shutdown()
        cluster.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
