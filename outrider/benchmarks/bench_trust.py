"""The price of not trusting a drafter: q-based vs deterministic verification at T > 0.

    python -m outrider.benchmarks.bench_trust --size tiny        # the committed report
    python -m outrider.benchmarks.bench_trust --size small --methods draft_model

A target verifies trees from a drafter it trusts with the drafter's q (accept x if
u * q(x) < p(x): with q = p every child is accepted) and trees from one it does not trust as
deterministic proposals (accept x with probability p(x): a child drawn from q = p survives
with probability sum p^2). Both are lossless (docs/algorithms.md section 2b); this measures
what the second costs in acceptance length and output token throughput, per method, at
T = 1 and T = 0.7, with the proposer in the engine's process and in a draft server over
loopback gRPC. Speculation off (`plain`) runs in the same rotation; speedups are ratios to
it within the same repeat, medians over repeats.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from outrider.benchmarks.report import add_run_arguments, write_run_report

METHOD_OPTIONS = {
    "draft_model": {"num_speculative_tokens": 4},
    "eagle3": {"num_speculative_tokens": 4},
    "mtp": {"num_speculative_tokens": 3},
}
TRUST = {"draft_q": True, "deterministic": False}


def run_once(runner, prompts, source, trusted: bool | None, temperature: float, max_tokens: int) -> dict:
    """One batch of seeded requests: tokens/s, acceptance length, per-position acceptance."""
    from outrider.proto import TreeBudget
    from outrider.target_worker.engine import Engine
    from outrider.target_worker.sequence import RequestParams

    if source is not None:
        source.trusts_q = trusted  # the operator's switch, per source (`DraftSource.trusts_q`)
    engine = Engine(
        runner, source, eos_token_id=None, max_batch=len(prompts), tree_budget=TreeBudget(16, 6, 4), lanes=1
    )
    params = [
        RequestParams(temperature=temperature, seed=i, max_tokens=max_tokens, ignore_eos=True)
        for i in range(len(prompts))
    ]
    started = time.perf_counter()
    completions = engine.generate(prompts, params)
    elapsed = time.perf_counter() - started
    spec = engine.stats.spec
    drafts = max(spec.num_drafts, 1)
    return {
        "tokens_per_s": sum(len(c.token_ids) for c in completions) / elapsed,
        "acceptance_length": 1 + spec.num_accepted_tokens / drafts if source is not None else None,
        "per_position": [round(n / drafts, 3) for n in spec.num_accepted_tokens_per_pos],
        "revoked": engine.trust is not None and engine.trust.revoked,
    }


def measure_method(runner, prompts, method, family, handshake, args) -> list[dict]:
    from outrider.benchmarks.bench_disagg import start_server, stop_server
    from outrider.draft_worker.server_cli import build_server_proposer
    from outrider.draft_worker.training.demo_heads import demo_head_dir, head_methods
    from outrider.target_worker.draft_client import DraftClientConfig, RemoteDraftSource
    from outrider.target_worker.draft_source import InProcessDraftSource

    options = METHOD_OPTIONS[method]
    model_dir = family.draft_dir if method == "draft_model" or method not in head_methods() else None
    model_dir = model_dir or demo_head_dir(family, method, progress=False, log=lambda _: None)
    server, port = start_server(
        {
            "method": method,
            "options": options,
            "draft_dir": str(model_dir),
            "tokenizer_dir": str(family.tokenizer_dir),
        }
    )
    remote = RemoteDraftSource([f"127.0.0.1:{port}"], handshake, DraftClientConfig(round_deadline_s=5.0))
    local = InProcessDraftSource(build_server_proposer(method, options, model_dir, family.tokenizer_dir))
    rows = []
    try:
        assert remote.wait_ready(60), f"the {method} draft server did not come up"
        modes = [("plain", None, None)]
        modes += [
            (f"{where}/{trust}", src, TRUST[trust])
            for where, src in (("in-process", local), ("grpc", remote))
            for trust in TRUST
        ]
        for temperature in args.temperatures:
            samples = {name: [] for name, _, _ in modes}
            for _, source, trusted in modes:  # warm-up, unmeasured
                run_once(runner, prompts, source, trusted, temperature, args.max_tokens)
            for repeat in range(args.repeats):
                shift = repeat % len(modes)
                for name, source, trusted in modes[shift:] + modes[:shift]:
                    samples[name].append(
                        run_once(runner, prompts, source, trusted, temperature, args.max_tokens)
                    )
            plain = [s["tokens_per_s"] for s in samples["plain"]]
            for name, _, _ in modes:
                runs = samples[name]
                where, _, trust = name.partition("/")
                row = {
                    "method": method if name != "plain" else "plain",
                    "temperature": temperature,
                    "drafter": where if trust else "—",
                    "verification": trust or "—",
                    "tokens_per_s": statistics.median(r["tokens_per_s"] for r in runs),
                    "speedup_vs_plain": statistics.median(
                        r["tokens_per_s"] / p for r, p in zip(runs, plain, strict=True)
                    ),
                    "acceptance_length": statistics.median(r["acceptance_length"] for r in runs)
                    if trust
                    else None,
                    "per_position_acceptance": runs[0]["per_position"] if trust else None,
                    "audit_revoked": any(r["revoked"] for r in runs) if trust else None,
                }
                rows.append(row)
                print(json.dumps(row), flush=True)
    finally:
        remote.close()
        stop_server(server)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", default="draft_model,eagle3,mtp", help="comma-separated proposers")
    parser.add_argument("--temperatures", default="1.0,0.7", type=lambda s: [float(t) for t in s.split(",")])
    parser.add_argument("--batch", type=int, default=4, help="requests decoded together")
    parser.add_argument("--repeats", type=int, default=3)
    add_run_arguments(parser, max_tokens=48, prompt_tokens=64)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)

    from outrider.benchmarks.bench_disagg import demo_handshake
    from outrider.benchmarks.prompts import mid_prompt_ids
    from outrider.demo.family import ensure_demo_family
    from outrider.target_worker.runner import ModelRunner

    family = ensure_demo_family(args.size)
    handshake = demo_handshake(family, args.size)
    prompts = mid_prompt_ids(family.tokenizer_dir, args.batch, args.prompt_tokens)
    runner = ModelRunner.from_pretrained(
        family.target_dir, max_model_len=1024, kv_cache_rows=args.batch * 512
    )
    rows = []
    for method in args.methods.split(","):
        rows += measure_method(runner, prompts, method, family, handshake, args)
    notes = (
        f"Demo family `{args.size}`, `mid` prompts of {args.prompt_tokens} tokens, batch {args.batch}, "
        f"{args.max_tokens} new tokens each, seeded requests, tree budget 16 nodes / depth 6 / top-k 4, one "
        f"torch thread per process, {args.repeats} repeats in rotating order after one unmeasured warm-up "
        "(medians; speedups are ratios to `plain` in the same repeat). `draft_q`: the drafter's q is "
        "trusted (q-based acceptance, audited); `deterministic`: its trees are verified as deterministic "
        "proposals (the default for external draft endpoints). `grpc`: the proposer in a draft server "
        "process over loopback, one lane. `per_position_acceptance`: share of drafts whose accepted path "
        "reached position k + 1 (first repeat). `audit_revoked`: whether the audit ever revoked trust. "
        "Method options: " + "; ".join(f"{m}: {METHOD_OPTIONS[m]}" for m in args.methods.split(","))
    )
    write_run_report("trust", rows, args, title="Trusted q vs deterministic verification", notes=notes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
