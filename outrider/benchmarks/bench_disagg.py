"""Disaggregated drafting: what the gRPC hop costs, and tokens/s remote vs. in-process.

    python -m outrider.benchmarks.bench_disagg --size small      # the issue's setting (builds the family once)
    python -m outrider.benchmarks.bench_disagg --size tiny --max-tokens 32   # a quick look

(a) Loopback round trip: a draft server in its own process answers every update with a fixed
    64-node tree with sparse q (top-8 rows), so the figure is transport + validation only;
    p50/p99 of submit -> collect, at batch 1 and 16.
(b) Tokens/s of the step engine, greedy, `mid` prompts, at batch 1, 4 and 16, per method
    (`--methods`, default ngram and draft_model): plain, the proposer in-process
    (co-located: drafting is on the target's critical path), and the same proposer in a draft
    server process (disaggregated), without and with the speculation cache
    (draft_worker.speculation: the server pre-drafts round r+1 for the likeliest verify
    outcomes while the target verifies round r and pushes those trees to the target, so a
    hit costs no round trip). The server reports its cache hits, misses and the drafting time
    the hits saved when it stops; `pushed_used` counts rounds a pushed tree answered. A method
    that cannot fork its state gets no cache; its "cache" rows say so instead of a figure.
    At batch > 1 the disaggregated engine may verify the batch in two lanes that take turns
    (target_worker.engine), so the server drafts one lane while the target verifies the other;
    it measures one lane against two as it runs (target_worker.lanes) and keeps the faster:
    `two_lane_share` is the share of its measured steps that ran two lanes.

Both processes use one torch thread each, so on the 2-core machine they run side by side:
the real-world point of disaggregation (the drafter has hardware of its own). With `--pin`
(the default) they are pinned to disjoint cores, as a deployment would give a draft worker
its own device (`pin_cores` says what unpinned costs here).
Each batch size runs plain, co-located and both disaggregated variants once unmeasured
(warm-up; each mode's lane tuner carries over to its measured runs, as in a long-running
server), then back to back `--repeats` times in rotating order; medians are reported,
speedups are ratios to plain within the same repeat.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

# The server process: `--echo` answers with fixed trees (transport only), else a real proposer.
SERVER_MAIN = """
import json, os, sys
args = json.loads(sys.argv[1])
if args.get("cpus"):  # before any thread exists: every thread the server starts inherits it
    os.sched_setaffinity(0, args["cpus"])
import torch
torch.set_num_threads(1)
from outrider.draft_worker.server import DraftIdentity, serve
from outrider.draft_worker.server_cli import build_server_proposer
from outrider.target_worker.draft_client import tokenizer_fingerprint
from pathlib import Path
if args["method"] == "echo":
    from outrider.draft_worker import build_proposer
    from outrider.proto import CandidateTree
    proposer = build_proposer({"method": "ngram", "num_speculative_tokens": 8, "tree_top_k": 8,
                               "tree_max_nodes": 64}, vocab_size=args["vocab_size"])
    shapes = [CandidateTree.make_dummy(64, vocab_size=args["vocab_size"], top_k=8, max_depth=8, seed=s)
              for s in range(8)]  # built once: the figure is transport, not tree building
    def propose(updates):
        trees = []
        for u in updates:
            if u.finished:
                continue
            shape = shapes[u.round % len(shapes)]
            tokens = shape.tokens.clone()
            tokens[0] = u.new_tokens[-1]
            trees.append(CandidateTree(**{**vars(shape), "seq_id": u.seq_id, "round": u.round, "tokens": tokens}))
        return trees
    proposer.propose = propose
else:
    proposer = build_server_proposer(args["method"], args["options"], Path(args["draft_dir"]),
                                     Path(args["tokenizer_dir"]))
identity = DraftIdentity(args["method"], proposer.vocab_size, tokenizer_fingerprint(args["tokenizer_dir"]))
from outrider.draft_worker.speculation import SpecCacheConfig
server = serve(proposer, identity, address="127.0.0.1:0",
               speculation_cache=SpecCacheConfig(args.get("outcomes", 4)) if args.get("cache") else None)
print(server.port, flush=True)
sys.stdin.read()
server.stop(2)
stats = server.stats
print(json.dumps({"cache_on": server.servicer.batcher.speculator is not None, **vars(stats)}), flush=True)
"""


# Each process multiplies by an 8 MB matrix (the small target's LM head), alone and then both
# at once: whether the two cores are independent hardware or share cache and memory bandwidth.
CONTENTION_MAIN = """
import json, os, sys
if len(sys.argv) > 1:
    os.sched_setaffinity(0, json.loads(sys.argv[1]))
import time, torch
torch.set_num_threads(1)
w, x = torch.randn(8192, 256), torch.randn(16, 256)
for _ in range(50):
    x @ w.t()
start, n = time.perf_counter(), 0
while time.perf_counter() - start < 2:
    x @ w.t()
    n += 1
print(1e6 * (time.perf_counter() - start) / n)
"""


def core_contention() -> dict:
    """Microseconds per LM-head-sized matmul, one process alone and two side by side."""

    def run(count: int) -> list[float]:
        env = dict(os.environ, OMP_NUM_THREADS="1")
        # Pinned like the target and the draft server: one process on each side.
        pins = [[json.dumps(half)] for half in PINNED] if PINNED else [[], []]
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", CONTENTION_MAIN, *pins[i]], stdout=subprocess.PIPE, text=True, env=env
            )
            for i in range(count)
        ]
        return [float(p.communicate()[0]) for p in procs]

    alone, paired = run(1)[0], statistics.mean(run(2))
    return {"measure": "core_contention", "alone_us": alone, "paired_us": paired, "slowdown": paired / alone}


def pin_cores() -> tuple[list[int], list[int]] | None:
    """(the target's CPUs, the draft server's): two disjoint halves of what this process may use,
    or None with fewer than two. Each process then keeps its own core and its caches:
    unpinned, a thread that wakes from waiting on the other process runs on whichever core is
    free. Measured here (draft_model, batch 1): the target's verify forward 8-12% slower than
    co-located unpinned, 4-9% pinned (README, "Disaggregation")."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return None
    half = len(cpus) // 2
    return cpus[:half], cpus[half:]


PINNED: tuple[list[int], list[int]] | None = None  # set by main() with --pin


def start_server(config: dict) -> tuple[subprocess.Popen, int]:
    if PINNED is not None:
        config = {**config, "cpus": PINNED[1]}
    env = dict(os.environ, OMP_NUM_THREADS="1")
    process = subprocess.Popen(
        [sys.executable, "-c", SERVER_MAIN, json.dumps(config)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    return process, int(process.stdout.readline())


def stop_server(process: subprocess.Popen) -> dict:
    """Stops the server process; returns the stats it printed (ServerStats + cache_on)."""
    process.stdin.close()
    out = process.stdout.read()
    process.wait(30)
    lines = [line for line in out.splitlines() if line.startswith("{")]
    return json.loads(lines[-1]) if lines else {}


def demo_handshake(family, size: str):
    """The handshake a target on the demo family sends its draft servers in these benchmarks."""
    from outrider.proto import Limits
    from outrider.target_worker.draft_client import target_handshake

    return target_handshake(
        family.target_dir, family.tokenizer_dir, model_id=f"demo-{size}-target", limits=Limits(256, 64, 8, 8)
    )


def round_trip(family, handshake, batch: int, iterations: int) -> dict:
    from outrider.proto import SamplingParams, SequenceUpdate, TreeBudget
    from outrider.target_worker.draft_client import DraftClientConfig, RemoteDraftSource

    process, port = start_server(
        {"method": "echo", "vocab_size": handshake.vocab_size, "tokenizer_dir": str(family.tokenizer_dir)}
    )
    source = RemoteDraftSource([f"127.0.0.1:{port}"], handshake, DraftClientConfig(round_deadline_s=5.0))
    try:
        assert source.wait_ready(30)
        budget = TreeBudget(64, 8, 8)
        times = []
        for i in range(iterations + 10):
            updates = [
                SequenceUpdate(
                    s, i, torch.tensor([1 + i % 7] * (32 if i == 0 else 1)), SamplingParams(), budget
                )
                for s in range(batch)
            ]
            started = time.perf_counter()
            source.submit(updates)
            trees = source.collect(list(range(batch)), 5.0)
            elapsed = time.perf_counter() - started
            assert len(trees) == batch and all(t.num_nodes == 64 for t in trees.values())
            if i >= 10:  # warm-up rounds out
                times.append(elapsed * 1e3)
        times.sort()
        return {
            "measure": "round_trip",
            "batch": batch,
            "tree_nodes": 64,
            "q_top_k": 8,
            "p50_ms": statistics.median(times),
            "p99_ms": times[int(0.99 * (len(times) - 1))],
        }
    finally:
        source.close()
        stop_server(process)


def throughput(
    runner, prompts, source, batch: int, max_tokens: int, tuner=None
) -> tuple[float, float | None, dict[int, int] | None]:
    """(tokens/s, acceptance length, steps per lane count when the engine chose them).

    `tuner`: the LaneTuner to use instead of a fresh one, so it keeps what it measured across
    the runs of one mode, as in a long-running server (a fresh one spends its first 16
    counted steps trying both modes, a large share of a short run)."""
    from outrider.proto import TreeBudget
    from outrider.target_worker.engine import Engine
    from outrider.target_worker.sequence import RequestParams

    engine = Engine(runner, source, eos_token_id=None, max_batch=batch, tree_budget=TreeBudget(16, 6, 4))
    if engine.lane_tuner is not None and tuner is not None:
        engine.lane_tuner = tuner
    before = dict(engine.lane_tuner.steps) if engine.lane_tuner is not None else None
    params = RequestParams(max_tokens=max_tokens, ignore_eos=True)
    started = time.perf_counter()
    completions = engine.generate(prompts, params)
    elapsed = time.perf_counter() - started
    tokens = sum(len(c.token_ids) for c in completions)
    tau = None
    if source is not None and engine.stats.num_rounds:
        spec = engine.stats.spec
        tau = 1 + spec.num_accepted_tokens / max(spec.num_drafts, 1)
    lanes = None
    if engine.lane_tuner is not None:
        lanes = {mode: count - before[mode] for mode, count in engine.lane_tuner.steps.items()}
    return tokens / elapsed, tau, lanes


METHOD_OPTIONS = {
    "ngram": {"num_speculative_tokens": 4},
    "suffix": {"num_speculative_tokens": 6},
    "draft_model": {"num_speculative_tokens": 4},
}


def compare_at_batch(runner, prompts, method, options, dirs, handshake, batch, args) -> list[dict]:
    """plain / co-located / disaggregated (cache off, on) at one batch size, `args.repeats` times."""
    from outrider.draft_worker.server_cli import build_server_proposer
    from outrider.target_worker.draft_client import DraftClientConfig, RemoteDraftSource
    from outrider.target_worker.draft_source import InProcessDraftSource
    from outrider.target_worker.lanes import LaneTuner

    servers, remotes = {}, {}
    for cache in (False, True):
        config = {"method": method, "options": options, "cache": cache, "outcomes": args.speculation_outcomes}
        servers[cache], port = start_server({**config, **dirs})
        remotes[cache] = RemoteDraftSource(
            [f"127.0.0.1:{port}"], handshake, DraftClientConfig(round_deadline_s=5.0)
        )
        assert remotes[cache].wait_ready(60)
    proposer = build_server_proposer(method, options, Path(dirs["draft_dir"]), Path(dirs["tokenizer_dir"]))
    local = InProcessDraftSource(proposer)
    sources = {
        "plain": None,
        "co-located": local,
        "disaggregated": remotes[False],
        "disaggregated+cache": remotes[True],
    }
    samples: dict[str, list[tuple[float, float | None]]] = {mode: [] for mode in sources}
    speedups: dict[str, list[float]] = {mode: [] for mode in sources}
    order = list(sources)
    tuners = {mode: LaneTuner() for mode in sources}  # one per mode, kept across its runs
    try:
        for mode, source in sources.items():  # warm-up, unmeasured: first forwards, a server's first rounds
            throughput(runner, prompts, source, batch, args.max_tokens, tuners[mode])
        for repeat in range(args.repeats):
            shift = repeat % len(order)
            this = {}
            for mode in order[shift:] + order[:shift]:
                this[mode] = throughput(runner, prompts, sources[mode], batch, args.max_tokens, tuners[mode])
                samples[mode].append(this[mode])
            for mode in sources:
                speedups[mode].append(this[mode][0] / this["plain"][0])
    finally:
        for remote in remotes.values():
            remote.close()
        stats = {cache: stop_server(server) for cache, server in servers.items()}
    pushed_used = {cache: remote.counters.trees_pushed_used for cache, remote in remotes.items()}
    rows = []
    for mode in sources:
        cache = mode == "disaggregated+cache"
        row = {
            "measure": "tokens_per_s",
            "method": method,
            "batch": batch,
            "mode": mode,
            "tokens_per_s": statistics.median(t for t, _, _ in samples[mode]),
            "speedup_vs_plain": statistics.median(speedups[mode]),
            "acceptance_length": samples[mode][0][1],
        }
        if mode.startswith("disaggregated"):
            steps = [lanes for _, _, lanes in samples[mode] if lanes and sum(lanes.values())]
            if steps:
                row["two_lane_share"] = sum(s[2] for s in steps) / sum(sum(s.values()) for s in steps)
            server = stats[cache]
            lookups = server.get("spec_cache_hits", 0) + server.get("spec_cache_misses", 0)
            row["cache_on"] = server.get("cache_on")
            row["cache_hit_rate"] = server["spec_cache_hits"] / lookups if lookups else None
            row["cache_saved_ms"] = 1e3 * server.get("spec_cache_saved_s", 0.0)
            row["server_drafting_ms"] = 1e3 * server.get("drafting_s", 0.0)
            row["pushed_used"] = pushed_used[cache]
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="small", help="demo family (default: %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--iterations", type=int, default=300, help="round trips per batch size")
    parser.add_argument("--batches", default="1,4,16")
    parser.add_argument("--methods", default="ngram,draft_model", help="comma-separated proposers")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--speculation-outcomes",
        type=int,
        default=4,
        help="verify outcomes pre-drafted per round (cache rows)",
    )
    parser.add_argument(
        "--results-dir", type=Path, default=None, help="where the reports go (default: benchmarks/results)"
    )
    parser.add_argument(
        "--pin",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="pin this process (target) and the draft server to disjoint cores (default: on)",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    global PINNED
    PINNED = pin_cores() if args.pin else None
    if PINNED is not None:  # before any thread starts: threads inherit the calling thread's mask
        os.sched_setaffinity(0, PINNED[0])

    from transformers import AutoTokenizer

    from outrider.benchmarks.prompts import load_prompts
    from outrider.benchmarks.report import write_report
    from outrider.demo.family import ensure_demo_family
    from outrider.target_worker.runner import ModelRunner

    family = ensure_demo_family(args.size)
    handshake = demo_handshake(family, args.size)
    rows = [core_contention(), *(round_trip(family, handshake, batch, args.iterations) for batch in (1, 16))]

    tokenizer = AutoTokenizer.from_pretrained(family.tokenizer_dir)
    batches = [int(b) for b in args.batches.split(",")]
    prompts = [
        p.token_ids
        for p in load_prompts("mid", tokenizer, count=max(batches), prompt_tokens=args.prompt_tokens)
    ]
    runner = ModelRunner.from_pretrained(
        family.target_dir, max_model_len=1024, kv_cache_rows=max(batches) * 512
    )
    dirs = {"draft_dir": str(family.draft_dir), "tokenizer_dir": str(family.tokenizer_dir)}
    for method in args.methods.split(","):
        options = dict(METHOD_OPTIONS[method])
        for batch in batches:
            rows += compare_at_batch(runner, prompts[:batch], method, options, dirs, handshake, batch, args)
    notes = (
        f"Demo family `{args.size}`, greedy, `mid` prompts of {args.prompt_tokens} tokens, {args.max_tokens} new "
        f"tokens each, {args.repeats} repeats in rotating order (medians) after one unmeasured warm-up "
        "run per mode; each disaggregated mode keeps its engine's lane tuner across its runs, as a "
        "long-running server does. One torch thread per process"
        + (
            f"; the target process is pinned to CPUs {PINNED[0]} and the draft server to {PINNED[1]}. "
            if PINNED
            else ", not pinned. "
        )
        + "co-located = the proposer in the engine's process, drafting on the critical path; "
        "disaggregated = a draft server process over loopback gRPC (at batch > 1 the engine verifies "
        "in one lane or two that take turns, whichever it measures faster: `two_lane_share` = the "
        "share of its measured steps that ran two lanes), without and with the speculation "
        "cache (`cache_hit_rate` = hits / lookups on the server; `cache_saved_ms` = drafting time "
        "the hits did not spend; `pushed_used` = rounds a pushed tree answered). `core_contention`: "
        "an 8 MB matmul (the target's LM head) alone and in both processes at once; a slowdown "
        "above 1 means the two cores share cache and memory bandwidth, so a drafter busy on the "
        "other core slows the target's forward. Method options: "
        + "; ".join(f"{m}: {METHOD_OPTIONS[m]}" for m in args.methods.split(","))
    )
    json_path, _ = write_report(
        f"disagg_{args.size}",
        rows,
        {"size": args.size, "argv": sys.argv[1:], "pinned": PINNED},
        title="Disaggregated drafting",
        notes=notes,
        columns=list(dict.fromkeys(key for row in rows for key in row)),
        **({"results_dir": args.results_dir} if args.results_dir else {}),
    )
    print(json.dumps(rows, indent=1))
    print(f"wrote {json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
