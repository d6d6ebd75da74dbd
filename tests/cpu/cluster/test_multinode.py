"""The distributed topology on one machine: a Ray cluster of five nodes, two applications.

    head     (2 CPUs)                          Serve controller, HTTP proxy, ingresses
    large x2 (1 GPU, outrider_target_gpu: 1)   target replicas only (no CPU)
    small x2 (1 GPU, outrider_draft_gpu: 1)    draft replicas only (no CPU)

The GPUs are declared, not real: Ray schedules on the same custom resources `gpu_pools`
derives from NVML, and the models run on the CPU. Application `pool` has two target
replicas and a draft deployment of two replicas; application `peer` has one target replica
and no drafters of its own: it drafts with `pool`'s (`draft_pool.shared_app`).

What must hold: replicas land on their pools; one draft pool serves both applications and
counts each; a target replica killed mid-stream costs no request (each of its choices
resumes on the other replica from the tokens already sent, token for token the uninterrupted
output); a draft node removed mid-load costs no request either. One cluster for the module
(about two minutes on two cores); the destructive tests run last.
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
import time

import pytest
from serve_testlib import MODEL, NO_CPUS, free_port, get, metric

from outrider.benchmarks.bench_autoscale import PROMPTS  # the load generator's prompts

pytestmark = pytest.mark.slow  # a five-node local Ray cluster: about two minutes on 2 cores

openai = pytest.importorskip("openai")

MAX_TOKENS = 90
SPEC = {"method": "ngram", "num_speculative_tokens": 4}


class Topology:
    def __init__(self, cluster, url: str, large: list, small: list):
        self.cluster, self.url, self.large, self.small = cluster, url, large, small
        self.reference: dict[str, str] = {}  # prompt -> the uninterrupted greedy completion

    def client(self, app: str):
        return openai.OpenAI(base_url=f"{self.url}/{app}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def topology(tiny_family):
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    from outrider.cluster.app import build_app, set_ray_env
    from outrider.cluster.gpu_pools import DRAFT_RESOURCE, TARGET_RESOURCE

    set_ray_env()
    # The dashboard serves the state API, which says where each actor runs.
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": True})
    # The ingresses ask for half a CPU and only the head has CPUs: Serve spreads replicas over
    # nodes, and an ingress on a small node would die with it in the last test (the client
    # sees a 500 from the proxy: a lost ingress, not a lost drafter).
    large = [cluster.add_node(num_cpus=0, num_gpus=1, resources={TARGET_RESOURCE: 1}) for _ in range(2)]
    small = [cluster.add_node(num_cpus=0, num_gpus=1, resources={DRAFT_RESOURCE: 1}) for _ in range(2)]
    ray.init(address=cluster.address, log_to_driver=False)
    cluster.wait_for_nodes()
    port = free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port}, proxy_location="HeadOnly")
        common = {"demo": "tiny", "speculative_config": SPEC, **NO_CPUS, "ingress_num_cpus": 0.5}
        engine = {"num_threads": 1, "max_num_seqs": 4}
        pool = {
            **common,
            "engine": engine,
            "target": {"num_cpus": 0, "num_replicas": 2, "gpus_per_rank": 0.5},
            "draft_pool": {"mode": "deployment", "num_cpus": 0, "num_replicas": 2, "round_deadline_ms": 1000},
        }
        serve.run(build_app(pool), name="pool", route_prefix="/pool")
        peer = {
            **common,
            "engine": engine,
            "target": {"num_cpus": 0, "num_replicas": 1, "gpus_per_rank": 0.5},
            "draft_pool": {"shared_app": "pool", "num_cpus": 0, "round_deadline_ms": 1000},
        }
        serve.run(build_app(peer), name="peer", route_prefix="/peer")
        topology = Topology(cluster, f"http://127.0.0.1:{port}", large, small)
        client = topology.client("pool")
        for prompt in PROMPTS:  # the uninterrupted run every later answer must equal
            answer = client.completions.create(
                model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0
            )
            assert answer.usage.completion_tokens == MAX_TOKENS
            topology.reference[prompt] = answer.choices[0].text
        yield topology
    finally:
        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()


def actors(topology: Topology, app: str, deployment: str) -> list:
    """The live replica actors of one deployment, from this cluster's state API (the address is
    explicit: another Ray on the same machine must not answer)."""
    from ray.util.state import list_actors

    filters = [("class_name", "=", f"ServeReplica:{app}:{deployment}"), ("state", "=", "ALIVE")]
    return list_actors(address=topology.cluster.address, filters=filters)


def complete(client, prompt: str, stream: bool, started: threading.Event | None = None) -> tuple[str, int]:
    """(text, completion tokens) of one greedy completion; sets `started` at its first text."""
    if not stream:
        answer = client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        return answer.choices[0].text, answer.usage.completion_tokens
    parts, tokens = [], 0
    chunks = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in chunks:
        if chunk.choices and chunk.choices[0].text:
            parts.append(chunk.choices[0].text)
            if started is not None:
                started.set()
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return "".join(parts), tokens


def under_load(
    topology: Topology, app: str, action, copies: int = 2, every: bool = True
) -> list[tuple[str, str, int]]:
    """Every prompt `copies` times on `app`, streamed and whole alternately; `action()` runs once
    every stream has produced text (`every`), or the first one has. Returns (prompt, text,
    completion tokens) per request."""
    client = topology.client(app)
    jobs = [(p, i % 2 == 0) for p in PROMPTS for i in range(copies)]
    events = [threading.Event() for _ in jobs]
    with cf.ThreadPoolExecutor(len(jobs)) as pool:
        futures = [pool.submit(complete, client, p, s, e) for (p, s), e in zip(jobs, events, strict=True)]
        if every:
            for (_, stream), event in zip(jobs, events, strict=True):
                assert not stream or event.wait(60), "a stream produced nothing"
        else:
            deadline = time.monotonic() + 60
            while not any(e.is_set() for e in events):
                assert time.monotonic() < deadline, "no stream produced anything"
                time.sleep(0.01)
        action()
        results = [f.result(timeout=180) for f in futures]
    return [(p, text, n) for (p, _), (text, n) in zip(jobs, results, strict=True)]


def trees_sent_to(page: str, app: str) -> float:
    """`outrider:draft_trees_sent_by_target_total` for target application `app`."""
    name, label = "outrider:draft_trees_sent_by_target_total{", f'target="{app}"'
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in page.splitlines() if line.startswith(name) and label in line
    )


def test_replicas_land_on_their_pools(topology):
    large = {n.node_id for n in topology.large}
    small = {n.node_id for n in topology.small}
    targets = actors(topology, "pool", "TargetWorker") + actors(topology, "peer", "TargetWorker")
    drafts = actors(topology, "pool", "DraftWorker")
    assert len(targets) == 3 and {a.node_id for a in targets} <= large
    assert len(drafts) == 2 and {a.node_id for a in drafts} == small  # one per small node
    assert actors(topology, "peer", "DraftWorker") == []  # `peer` drafts with `pool`'s replicas


def test_one_draft_pool_serves_both_applications(topology):
    def peer_requests() -> None:  # beside the load on `pool`
        client = topology.client("peer")
        for prompt in PROMPTS[:3]:
            text, n = complete(client, prompt, stream=False)
            assert (text, n) == (topology.reference[prompt], MAX_TOKENS)

    for prompt, text, n in under_load(topology, "pool", peer_requests, copies=1):
        assert (text, n) == (topology.reference[prompt], MAX_TOKENS)
    deadline = time.monotonic() + 15  # draft replicas announce their counters every 2 s
    while True:
        page = get(f"{topology.url}/pool/metrics")[1]
        per_target = {app: trees_sent_to(page, app) for app in ("pool", "peer")}
        if all(per_target.values()) or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert per_target["pool"] > 0 and per_target["peer"] > 0, per_target


def test_target_replica_killed_mid_stream_resumes_token_exact(topology):
    import ray

    victim = actors(topology, "pool", "TargetWorker")[0]
    before = metric(get(f"{topology.url}/pool/metrics")[1], "outrider:request_resumes_total")

    def kill() -> None:
        ray.kill(ray.get_actor(victim.name, namespace="serve"), no_restart=True)

    # Killed at the first streamed text, while every choice is still running: once all had
    # text (90 tokens of ngram speculation on the tiny demo), the victim's could be done.
    for prompt, text, n in under_load(topology, "pool", kill, every=False):
        assert (text, n) == (topology.reference[prompt], MAX_TOKENS), prompt
    resumed = metric(get(f"{topology.url}/pool/metrics")[1], "outrider:request_resumes_total") - before
    assert resumed >= 1  # the victim held some of the 12 choices; each went on elsewhere


def test_ingress_killed_mid_stream_is_a_clean_error_not_a_hang(topology):
    """The ingress holds the client's connection: when it dies the stream ends at once, without
    OpenAI's [DONE] sentinel (the client knows the answer is incomplete), and Serve's restarted
    ingress answers the next request."""
    import http.client
    import json
    from urllib.parse import urlparse

    import ray

    (ingress,) = actors(topology, "pool", "OpenAIIngress")
    victim = ray.get_actor(ingress.name, namespace="serve")
    url = urlparse(topology.url)
    connection = http.client.HTTPConnection(url.hostname, url.port, timeout=30)  # a hang fails here
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
    client = topology.client("pool")
    with cf.ThreadPoolExecutor(8) as background:  # a busy server, so the stream is slow enough to cut
        for prompt in PROMPTS + PROMPTS[:2]:
            background.submit(complete, client, prompt, False)
        time.sleep(0.5)
        connection.request(
            "POST", "/pool/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
        )
        response = connection.getresponse()
        assert response.status == 200
        assert response.readline().startswith(b"data: ")  # the stream is under way
        started = time.monotonic()
        ray.kill(victim, no_restart=True)
        rest = b""
        try:
            while chunk := response.read1(65536):
                rest += chunk
        except (http.client.IncompleteRead, ConnectionError) as error:  # also a clean end
            rest += getattr(error, "partial", b"")
        assert time.monotonic() - started < 30
        assert b"data: [DONE]" not in rest
        connection.close()
    deadline = time.monotonic() + 60  # Serve restarts the ingress replica
    while True:
        try:
            text, n = complete(topology.client("pool"), PROMPTS[1], stream=False)
            break
        except openai.APIError:
            assert time.monotonic() < deadline
            time.sleep(1)
    assert (text, n) == (topology.reference[PROMPTS[1]], MAX_TOKENS)


def test_draft_node_removed_mid_load(topology):
    drafts = {a.node_id for a in actors(topology, "pool", "DraftWorker")}
    # Both ingresses live on the head (the only node with CPUs), restarted or not: removing a
    # node that held one would kill it too, which is a different test.
    ingresses = {a.node_id for app in ("pool", "peer") for a in actors(topology, app, "OpenAIIngress")}
    assert ingresses == {topology.cluster.head_node.node_id}
    node = next(n for n in topology.small if n.node_id in drafts)

    def remove() -> None:
        topology.cluster.remove_node(node, allow_graceful=False)

    for prompt, text, n in under_load(topology, "pool", remove):
        assert (text, n) == (topology.reference[prompt], MAX_TOKENS), prompt
    # The survivor drafts for both applications; the shared one's answers stay exact too.
    text, n = complete(topology.client("peer"), PROMPTS[0], stream=True)
    assert (text, n) == (topology.reference[PROMPTS[0]], MAX_TOKENS)
