"""The draft server in its own process, started through `outrider draft-server`'s parser,
killed with SIGKILL mid-generation and restarted on the same port: every request completes
with the plain greedy output, unspeculated while no worker is up, and the client reconnects
and re-syncs each sequence's full context to the new process.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

from draft_client_testlib import StopAfter, client, encode_prompts, generate, load_runner

SERVER_MAIN = """
import argparse, sys
from outrider.draft_worker.server_cli import add_draft_server_parser
parser = argparse.ArgumentParser(prog="outrider")
add_draft_server_parser(parser.add_subparsers(dest="command", required=True))
args = parser.parse_args(sys.argv[1:])
sys.exit(args.func(args))
"""


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_process(port: int, tokenizer_dir) -> subprocess.Popen:
    argv = ["draft-server", "--method", "ngram", "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--tokenizer", str(tokenizer_dir), "--num-speculative-tokens", "4"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    process = subprocess.Popen(
        [sys.executable, "-c", SERVER_MAIN, *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env=env,
        text=True,
    )
    line = process.stdout.readline()  # "draft server: ... on port P" once it listens
    assert f"on port {port}" in line, line
    return process


def test_kill_and_restart_mid_generation(tiny_family):
    runner = load_runner(tiny_family.target_dir)
    prompts = encode_prompts(tiny_family.tokenizer_dir)
    plain = generate(runner, prompts)[0]
    port = free_port()
    processes = [start_process(port, tiny_family.tokenizer_dir)]
    source = client(tiny_family, [f"127.0.0.1:{port}"], round_deadline_s=5.0)

    def kill() -> None:
        processes[0].send_signal(signal.SIGKILL)
        processes[0].wait(10)

    def restart() -> None:
        processes.append(start_process(port, tiny_family.tokenizer_dir))
        deadline = time.monotonic() + 10
        while not source.endpoints[0].healthy:  # so the rest of the run speculates again
            assert time.monotonic() < deadline
            time.sleep(0.01)

    try:
        assert source.wait_ready(20)
        outputs, before = generate(runner, prompts, StopAfter(source, 4, kill))
        assert outputs == plain
        assert before.num_trees > 0 and before.num_missing_trees > 0 and not source.endpoints[0].healthy
        outputs, during = generate(runner, prompts, StopAfter(source, 3, restart))
        assert outputs == plain
        assert during.num_trees > 0  # speculating again once the new process was up
        assert source.counters.reconnects >= 1 and source.counters.resyncs >= len(prompts)
        assert source.counters.trees_invalid == 0
    finally:
        source.close()
        for process in processes:
            process.kill()
            process.wait(10)
