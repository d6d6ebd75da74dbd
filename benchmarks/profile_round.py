"""Where a round's time goes: the engine's hot path, profiled per phase.

    python -m outrider.benchmarks.profile_round --size tiny      # the committed report
    python -m outrider.benchmarks.profile_round --size small --methods plain,ngram

For each method (plain, ngram, draft_model, eagle3, medusa), temperature (0, 1) and batch
size (1, 16), one batch of requests runs under cProfile and every function's own time is
charged to a phase by the module it lives in:

    forward    the target model (target_worker/models, layers, runner, batch building)
    drafting   the proposer (draft_worker/*) inside `collect`
    verify     kernels/verification, logits processing, random numbers
    plan       round planning, tree packing, validation (round_plan, packing, proto)
    policy     the speculation policy and the trust checks
    engine     the rest of target_worker/engine, sequences, KV bookkeeping
    torch/py   torch and Python internals not attributed above (tensor creation, lists)

Reported per round in microseconds (cProfile adds its own overhead, the same for every
row; read shares, not absolutes), with tokens per round and tokens per second measured
without the profiler right before.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
import time
from pathlib import Path

import torch

PHASES = (
    ("drafting", ("draft_worker/",)),
    (
        "forward",
        (
            "target_worker/models/",
            "target_worker/layers/",
            "target_worker/runner.py",
            "target_worker/batch.py",
        ),
    ),
    ("verify", ("kernels/verification", "kernels/logits_processing", "kernels/spec_metrics")),
    ("plan", ("target_worker/round_plan.py", "kernels/packing.py", "proto/", "kernels/tree_buffers.py")),
    ("policy", ("target_worker/spec_policy.py", "target_worker/draft_trust.py")),
    ("engine", ("target_worker/",)),
)


def phase_of(filename: str) -> str:
    path = filename.replace("\\", "/")
    for phase, markers in PHASES:
        if any(marker in path for marker in markers) and "site-packages" not in path:
            return phase
    return "torch/py"


def configs(family, heads: dict[str, Path]) -> dict[str, dict | None]:
    out = {
        "plain": None,
        "ngram": {
            "method": "ngram",
            "num_speculative_tokens": 4,
            "prompt_lookup_min": 1,
            "prompt_lookup_max": 4,
        },
        "draft_model": {"method": "draft_model", "model": str(family.draft_dir), "num_speculative_tokens": 4},
    }
    for method in ("eagle3", "medusa"):
        if method in heads:
            out[method] = {"method": method, "model": str(heads[method]), "num_speculative_tokens": 4}
    return out


def one_run(runner, prompts, config, temperature, max_tokens):
    from outrider.draft_worker import build_proposer
    from outrider.target_worker.draft_source import InProcessDraftSource
    from outrider.target_worker.engine import Engine
    from outrider.target_worker.sequence import RequestParams

    source = None
    if config is not None:
        source = InProcessDraftSource(build_proposer(config, vocab_size=runner.model.vocab_size))
    engine = Engine(runner, source, eos_token_id=None, max_batch=len(prompts))
    params = [
        RequestParams(temperature=temperature, seed=i, max_tokens=max_tokens, ignore_eos=True)
        for i in range(len(prompts))
    ]
    for i, prompt in enumerate(prompts):
        engine.add_request(prompt, params[i])
    while any(not s.decoding for s in [*engine.waiting, *engine.running]):
        engine.step()  # prompts prefilled outside the measurement: decode rounds only
    return engine


def measure(runner, prompts, config, temperature, max_tokens) -> dict:
    engine = one_run(runner, prompts, config, temperature, max_tokens)
    rounds0, tokens0 = engine.stats.num_rounds, engine.stats.num_output_tokens
    started = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    elapsed = time.perf_counter() - started
    rounds, tokens = engine.stats.num_rounds - rounds0, engine.stats.num_output_tokens - tokens0

    engine = one_run(runner, prompts, config, temperature, max_tokens)
    profile = cProfile.Profile()
    profile.enable()
    while engine.has_unfinished():
        engine.step()
    profile.disable()
    stats = pstats.Stats(profile)
    phases: dict[str, float] = {}
    for (filename, _, _), (_, _, own, _, _) in stats.stats.items():
        phase = phase_of(filename)
        phases[phase] = phases.get(phase, 0.0) + own
    total = sum(phases.values())
    return {
        "tokens_per_s": tokens / elapsed,
        "tokens_per_round": tokens / max(rounds, 1),
        "round_us": 1e6 * elapsed / max(rounds, 1),
        **{f"{p}_share": phases.get(p, 0.0) / total for p, _ in (*PHASES, ("torch/py", ()))},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="tiny", help="demo family (default: %(default)s)")
    parser.add_argument("--methods", default="plain,ngram,draft_model,eagle3,medusa")
    parser.add_argument("--batches", default="1,16", type=lambda s: [int(b) for b in s.split(",")])
    parser.add_argument("--temperatures", default="0,1", type=lambda s: [float(t) for t in s.split(",")])
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--prompt-tokens", type=int, default=48)
    parser.add_argument("--results-dir", type=Path, default=None, help="default: benchmarks/results")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)

    from transformers import AutoTokenizer

    from outrider.benchmarks.prompts import load_prompts
    from outrider.benchmarks.report import write_report
    from outrider.demo.family import ensure_demo_family
    from outrider.draft_worker.training.demo_heads import demo_head_dir
    from outrider.target_worker.runner import ModelRunner

    family = ensure_demo_family(args.size)
    methods = args.methods.split(",")
    heads = {
        m: demo_head_dir(family, m, progress=False, log=lambda _: None)
        for m in ("eagle3", "medusa")
        if m in methods
    }
    table = {k: v for k, v in configs(family, heads).items() if k in methods}
    tokenizer = AutoTokenizer.from_pretrained(family.tokenizer_dir)
    most = max(args.batches)
    prompts = [
        p.token_ids for p in load_prompts("mid", tokenizer, count=most, prompt_tokens=args.prompt_tokens)
    ]
    context = args.prompt_tokens + args.max_tokens + 16
    runner = ModelRunner.from_pretrained(
        family.target_dir, max_model_len=context, kv_cache_rows=most * context
    )
    rows = []
    for method, config in table.items():
        for temperature in args.temperatures:
            for batch in args.batches:
                row = {"method": method, "temperature": temperature, "batch": batch}
                row |= measure(runner, prompts[:batch], config, temperature, args.max_tokens)
                rows.append(row)
                print(json.dumps(row), flush=True)
    notes = (
        f"Demo family `{args.size}`, `mid` prompts of {args.prompt_tokens} tokens, {args.max_tokens} new tokens, "
        "decode rounds only (prompts prefilled first), fixed budgets (each method's own K, chains), one torch "
        "thread. `round_us`, `tokens_per_round` and `tokens_per_s` are measured without the profiler; the "
        "`*_share` columns split cProfile's own-time per function by the module it lives in (module docstring "
        "of benchmarks/profile_round.py); they add up to 1."
    )
    json_path, _ = write_report(
        f"profile_round_{args.size}",
        rows,
        {"size": args.size, "argv": sys.argv[1:]},
        title="Where a round's time goes",
        notes=notes,
        columns=list(dict.fromkeys(key for row in rows for key in row)),
        **({"results_dir": args.results_dir} if args.results_dir else {}),
    )
    print(f"wrote {json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
