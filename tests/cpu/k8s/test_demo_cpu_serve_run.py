"""k8s/demo-cpu.yaml's Serve config, extracted, runs under Ray Serve's own `serve run` CLI.

The config goes to `serve run` as the manifest has it, with three changes a laptop needs: the
tiny demo family instead of `small` (built in seconds by the session fixture), a free HTTP
port, and Ray's logical CPUs set to what the manifest's head plus one worker pod declare
(`RAY_OVERRIDE_RESOURCES`), so replicas reserve exactly what they would on Kubernetes. One
completion through the official `openai` client, then Ctrl-C, and no Ray process may be left.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest
import yaml
from k8s_testlib import K8S, REPO, node_resources, ray_services, serve_config

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow  # a local Ray cluster started by `serve run`: ~30 s on 2 cores

MANIFEST = K8S / "demo-cpu.yaml"
SERVE = REPO / ".venv" / "bin" / "serve"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def local_config(port: int) -> tuple[dict, dict[str, float]]:
    """(the Serve config to run, Ray's logical resources: head + one worker pod)."""
    (service,) = ray_services(MANIFEST)
    config = serve_config(service)
    (app,) = config["applications"]
    assert app["args"]["demo"] == "small", "the manifest serves the small family; the test swaps in tiny"
    app["args"]["demo"] = "tiny"
    config["http_options"]["port"] = port
    cluster = service["spec"]["rayClusterConfig"]
    (workers,) = cluster["workerGroupSpecs"]
    cpus = node_resources(cluster["headGroupSpec"])["CPU"] + node_resources(workers)["CPU"]
    return config, {"CPU": cpus}


def processes_under(marker: str) -> list[int]:
    """Live processes whose command line names `marker` (our Ray session's temp dir)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in cmdline:
            found.append(int(entry.name))
    return found


def sum_metric(page: str, name: str) -> float:
    """Sum of every sample of `name` (any labels) on a Prometheus page."""
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in page.splitlines()
        if line.split("{")[0].split(" ")[0] == name
    )


def wait_ready(url: str, server: subprocess.Popen, log: Path, timeout_s: float = 240) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            pytest.fail(f"serve run exited with {server.returncode}:\n{log.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    pytest.fail(f"the demo app was not healthy within {timeout_s:.0f} s:\n{log.read_text()[-4000:]}")


def test_demo_cpu_serve_config_runs_under_serve_run(tiny_family, tmp_path):
    port = free_port()
    config, resources = local_config(port)
    config_file = tmp_path / "demo-cpu.serve.yaml"
    config_file.write_text(yaml.safe_dump(config, sort_keys=False))
    # A short private temp dir: Ray's socket paths must stay under ~107 bytes, and every Ray
    # process of this run names it on its command line, which is how we find leftovers.
    ray_tmp = tempfile.mkdtemp(prefix="ork8s-", dir="/tmp")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(RAY_TMPDIR=ray_tmp, RAY_OVERRIDE_RESOURCES=json.dumps(resources))
    log = tmp_path / "serve-run.log"
    with log.open("w") as out:
        server = subprocess.Popen(
            [str(SERVE), "run", "--address", "local", str(config_file)],
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            # A runner that launched the suite in the background (`cmd &`) hands SIGINT down
            # ignored, and Python then installs no KeyboardInterrupt handler: the Ctrl-C below
            # would do nothing. Give `serve run` the default disposition a terminal gives it.
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, server, log)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        completion = client.completions.create(
            model="outrider-demo-tiny", prompt="def fibonacci(n):\n", max_tokens=16, temperature=0
        )
        assert completion.choices[0].text
        assert completion.usage.completion_tokens > 0
        assert completion.choices[0].finish_reason in ("length", "stop")
        # The manifest's speculative_config is in force: the demo draft LM proposed tokens.
        with urllib.request.urlopen(f"{url}/metrics", timeout=30) as response:
            page = response.read().decode()
        assert sum_metric(page, "outrider:spec_decode_num_draft_tokens_total") > 0
    finally:
        if server.poll() is None:
            server.send_signal(signal.SIGINT)  # serve run's Ctrl-C: shut Serve down, then Ray
            try:
                server.wait(timeout=180)  # Serve drains its replicas first: slow under load
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()
        time.sleep(1)  # Ray's daemons exit just after the driver does
        left = processes_under(ray_tmp)
        for pid in left:  # ours by construction: they name our private temp dir
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert server.returncode == 0, log.read_text()[-4000:]
    assert not left, f"Ray processes left after serve run exited: {left}"
