"""Helpers for the end-to-end Serve tests: one local Ray per module, apps on route prefixes."""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request
from contextlib import contextmanager

# Replicas reserve no CPUs: 2 shared cores would otherwise not fit ingress + targets + drafts.
NO_CPUS = {"target": {"num_cpus": 0}, "draft_pool": {"num_cpus": 0}, "ingress_num_cpus": 0}
MODEL = "outrider-demo-tiny"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def local_serve(num_cpus: int = 2):
    """Ray + Serve on this machine; yields the HTTP base URL."""
    import ray
    from ray import serve

    from outrider.cluster.app import set_ray_env

    set_ray_env()  # as `outrider serve` starts Ray
    ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
    port = free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def deploy(name: str, args: dict, family) -> None:
    from ray import serve

    from outrider.cluster.app import build_app

    merged = {"demo": "tiny", "engine": {"num_threads": 1}, **NO_CPUS, **args}
    serve.run(build_app(merged), name=name, route_prefix=f"/{name}")


def post(url: str, body: bytes | dict) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=60) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def metric(page: str, name: str) -> float:
    """Sum of every sample of `name` (any labels) on a Prometheus page."""
    total = 0.0
    for line in page.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total
