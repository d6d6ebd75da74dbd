"""Where a round's time goes: the engine's hot path, profiled per phase.

    python -m outrider.benchmarks.profile_round --size tiny      # the committed report
    python -m outrider.benchmarks.profile_round --size small --methods plain,ngram

For each method (plain, ngram, draft_model, eagle3, medusa), temperature (0, 1) and batch
size (1, 16), the decode rounds of one batch of requests run under cProfile, and each
phase of `Engine.step` is charged the cumulative time of the functions that make it up:

    forward    ModelRunner.forward called by `Engine.step`: the target model (a draft model's
               own forward is drafting)
    drafting   the draft source's collect (in-process proposers draft inside it) and submit
    verify     target probabilities (logits processing), random numbers, kernels.verify
    plan       tree checks (`_checked_trees`, trust demotion included) and `plan_round` (packing)
    policy     the speculation policy (budgets, observe) and the trust audit
    commit     KV path compaction, appending outputs, acceptance counters
    other      the rest of `Engine.step` (admission, lanes, deltas, bookkeeping)

Reported as shares of `Engine.step`'s time (cProfile's overhead inflates Python-heavy
phases alike for every row: read shares side by side, not as absolute costs), with tokens
per round, microseconds per round and tokens per second measured without the profiler.
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

from outrider.benchmarks.report import add_run_arguments, write_run_report

PHASES = {
    "forward": (("outrider/target_worker/runner.py", "forward"),),
    "drafting": (("draft_source.py", "collect"), ("draft_source.py", "submit"), ("target.py", "collect")),
    "verify": (
        ("outrider/target_worker/verify_inputs.py", "target_probs"),
        ("outrider/target_worker/verify_inputs.py", "verify_randoms"),
        ("outrider/target_worker/verify_inputs.py", "greedy_rows"),
        ("outrider/kernels/verification.py", "verify"),
    ),
    "plan": (
        ("outrider/target_worker/engine.py", "_checked_trees"),
        ("outrider/target_worker/round_plan.py", "plan_round"),
        ("outrider/target_worker/kv_scheduler.py", "reserve"),
    ),
    "policy": (
        ("outrider/target_worker/spec_policy.py", "budgets"),
        ("outrider/target_worker/spec_policy.py", "observe_round"),
        ("outrider/target_worker/draft_trust.py", "audit"),
    ),
    "commit": (
        ("outrider/target_worker/kv_cache.py", "compact"),
        ("outrider/target_worker/kv_scheduler.py", "settle"),
        ("outrider/target_worker/engine.py", "_append_outputs"),
        ("outrider/kernels/spec_metrics.py", "observe"),
    ),
}


def phase_shares(stats: pstats.Stats) -> dict[str, float]:
    """Each phase's cumulative time as a share of `Engine.step`'s."""
    cumulative: dict[tuple[str, str], float] = {}
    for (filename, _, name), (_, _, _, cum, _) in stats.stats.items():
        key = (filename.replace("\\", "/"), name)
        cumulative[key] = cumulative.get(key, 0.0) + cum

    def total(suffix: str, name: str) -> float:
        return sum(t for (f, n), t in cumulative.items() if n == name and f.endswith(suffix))

    def called_from_step(suffix: str, name: str) -> float:
        """Cumulative time of `name` in the calls `Engine.step` made itself (a draft model's own
        runner.forward, called from the drafter, is drafting, not the target's forward).
        `ModelRunner.forward` runs under `torch.inference_mode()`, whose wrapper is what
        `step` calls (the only such function `step` calls)."""
        out = 0.0
        for (filename, _, fname), (_, _, _, _, callers) in stats.stats.items():
            path = filename.replace("\\", "/")
            if (fname == name and path.endswith(suffix)) or fname == "decorate_context":
                out += sum(
                    c[3] for (cf, _, cn), c in callers.items() if cn == "step" and cf.endswith("engine.py")
                )
        return out

    step = total("outrider/target_worker/engine.py", "step")
    shares = {phase: sum(total(f, n) for f, n in parts) / step for phase, parts in PHASES.items()}
    shares["forward"] = called_from_step("outrider/target_worker/runner.py", "forward") / step
    shares["other"] = max(0.0, 1.0 - sum(shares.values()))
    return shares


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
    shares = phase_shares(pstats.Stats(profile))
    return {
        "tokens_per_s": tokens / elapsed,
        "tokens_per_round": tokens / max(rounds, 1),
        "round_us": 1e6 * elapsed / max(rounds, 1),
        **{f"{phase}_share": share for phase, share in shares.items()},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", default="plain,ngram,draft_model,eagle3,medusa")
    parser.add_argument("--batches", default="1,16", type=lambda s: [int(b) for b in s.split(",")])
    parser.add_argument("--temperatures", default="0,1", type=lambda s: [float(t) for t in s.split(",")])
    add_run_arguments(parser, max_tokens=48, prompt_tokens=48)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)

    from outrider.benchmarks.prompts import mid_prompt_ids
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
    most = max(args.batches)
    prompts = mid_prompt_ids(family.tokenizer_dir, most, args.prompt_tokens)
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
        "`*_share` columns are each phase's cumulative time under cProfile as a share of `Engine.step`'s "
        "(phases in the module docstring of outrider/benchmarks/profile_round.py); they add up to 1."
    )
    write_run_report("profile_round", rows, args, title="Where a round's time goes", notes=notes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
