"""The speculation policy against fixed K, and how much of the ideal the engine realises.

    python -m outrider.benchmarks.bench_policy --size tiny             # the committed report
    python -m outrider.benchmarks.bench_policy --size small --batches 1 --methods ngram,draft_model

For each method, temperature and batch size: plain decoding, fixed K in {1, 2, 4, 8} (every
sequence drafts K tokens every round: vLLM's behaviour) and the adaptive policy (ceiling 8;
outrider/target_worker/spec_policy.py), one engine each on the same weights (its own KV cache),
stepped in lockstep (`run_lockstep`), `--repeats` times after one unmeasured warm-up; medians;
speedups are ratios to plain within the same repeat.

The `replay-a` methods propose the target's own recorded greedy continuation with each token
replaced with probability 1 - a (outrider/benchmarks/replay_drafter.py): at T = 0 a K-chain keeps
tau(K) = (1 - a^(K+1)) / (1 - a) tokens per round for next to no drafting time, so the ideal
speedup of fixed K is tau(K) x verify(B) / verify(B (K + 1)), with verify = a + b N + u B + j J seconds
fitted in the same run (the adaptive engine's own cost line); the report puts it beside the
realised one, and the adaptive row beside the best fixed K.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from outrider.benchmarks.report import add_run_arguments, write_run_report

FIXED_KS = (1, 2, 4, 8)
CEILING_DEPTH = 8
ADMISSIONS = ("waves", "continuous")


def specs(method: str, family, recording: Path) -> dict:
    if method.startswith("replay-"):
        return {"method": "replay", "acceptance": float(method.split("-")[1]), "recording": str(recording)}
    if method == "draft_model":
        return {"method": "draft_model", "model": str(family.draft_dir)}
    if method == "ngram":
        return {"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 4}
    raise ValueError(f"unknown method {method!r}; use ngram, draft_model or replay-<a>")


def run_once(
    runner, prompts, spec, mode: str, temperature: float, max_tokens: int, policies: dict, seed: int = 0,
    batch: int | None = None, admission: str = "waves",
) -> dict:  # fmt: skip
    """`run_lockstep` of one mode, alone on `runner`'s KV cache."""
    alone = (seed, batch, admission, False)  # (own_caches: none, the runner's)
    return run_lockstep(runner, prompts, spec, [mode], temperature, max_tokens, policies, *alone)[mode]


def run_lockstep(
    runner, prompts, spec, modes: list[str], temperature: float, max_tokens: int, policies: dict,
    seed: int = 0, batch: int | None = None, admission: str = "waves", own_caches: bool = True,
) -> dict[str, dict]:  # fmt: skip
    """The same seeded requests on one engine per mode (the runner's weights; each its own KV
    cache unless `own_caches` is False), stepped in lockstep: always the engine whose steps
    have taken least time so far (ties: in `modes`' order), as `outrider bench` steps its
    engines beside a plain partner. Run one after the other, the same configuration's round
    at batch 16 measured 8.0, 11.4 and 11.0 ms in three runs minutes apart on this machine;
    stepped together every mode meets the same moments of it.

    `batch` requests at a time (None: all at once): in `waves`, each `batch` start together
    and the next wait for the last of them (a run of one 64-token request lasted ~80 ms: too
    short to time); `continuous`, a request takes the slot of one that finished, as a server
    keeps its batch full. The adaptive policy in `policies[mode]` carries over from run to
    run, as in a long-running server (a fresh one spends its first rounds measuring every
    depth). `seed` seeds the replay drafter's corruptions: each repeat draws afresh (with one
    seed every repeat of a fixed K would keep exactly the same tokens)."""
    from outrider.target_worker.kv_cache import KVCache
    from outrider.target_worker.runner import ModelRunner
    from outrider.target_worker.sequence import RequestParams

    if admission not in ADMISSIONS:
        raise ValueError(f"admission {admission!r}; use one of {ADMISSIONS}")
    size = (batch or len(prompts)) if admission == "waves" else len(prompts)  # requests added at once
    params = [
        RequestParams(temperature=temperature, seed=i, max_tokens=max_tokens, ignore_eos=True)
        for i in range(len(prompts))
    ]
    engines, before = [], []
    for mode in modes:
        own = runner
        if own_caches:
            own = ModelRunner(runner.model, KVCache(runner.model.kv_spec(), runner.cache.total_rows,
                                                    runner.device), runner.max_model_len)  # fmt: skip
        engine = _engine(own, spec, mode, policies, seed, batch or len(prompts))
        engines.append(engine)
        before.append(list(engine.policy.stats.depth_counts) if engine.policy is not None else None)
    tokens, spent, added = [0] * len(modes), [0.0] * len(modes), [0] * len(modes)
    full = [[0, 0.0] for _ in modes]  # tokens and seconds of the steps with every slot taken
    live = list(range(len(modes)))
    while live:
        i = min(live, key=spent.__getitem__)
        engine = engines[i]
        started = time.perf_counter()
        if not engine.has_unfinished():
            if added[i] == len(prompts):
                live.remove(i)
                continue
            wave = range(added[i], min(added[i] + size, len(prompts)))
            for r in wave:
                engine.add_request(prompts[r], params[r])
            added[i] = wave.stop
        filled = len(engine.running) + len(engine.waiting) >= engine.kv.max_batch
        new = sum(len(o.new_token_ids) for o in engine.step())
        seconds = time.perf_counter() - started
        tokens[i], spent[i] = tokens[i] + new, spent[i] + seconds
        if filled:
            full[i][0], full[i][1] = full[i][0] + new, full[i][1] + seconds
    return {mode: _row(engines[i], tokens[i] / spent[i], full[i], before[i]) for i, mode in enumerate(modes)}


def _median(values) -> float | None:
    """The median of the values that are not None; None if none are."""
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def _engine(runner, spec, mode: str, policies: dict, seed: int, max_batch: int):
    from outrider.draft_worker import build_proposer
    from outrider.proto import TreeBudget
    from outrider.target_worker.draft_source import InProcessDraftSource
    from outrider.target_worker.engine import Engine

    source, depth = None, CEILING_DEPTH if mode == "adaptive" else (int(mode[1:]) if mode != "plain" else 0)
    if mode != "plain":
        config = {**spec, "num_speculative_tokens": depth}
        if spec["method"] == "replay":
            config["seed"] = seed
        source = InProcessDraftSource(build_proposer(config, vocab_size=runner.model.vocab_size))
    engine = Engine(
        runner,
        source,
        eos_token_id=None,
        max_batch=max_batch,
        tree_budget=TreeBudget(max_nodes=depth + 1, max_depth=max(depth, 1), top_k=1),
        budget_policy="adaptive" if mode == "adaptive" else "fixed",
    )
    if engine.policy is not None:
        engine.policy = policies.setdefault(mode, engine.policy)
    return engine


def _row(engine, tokens_per_s: float, full: list, before: list[int] | None) -> dict:
    """`full`: the tokens and seconds of the steps with every slot taken."""
    spec_stats, policy = engine.stats.spec, engine.policy
    drafts = max(spec_stats.num_drafts, 1)
    row = {
        "tokens_per_s": tokens_per_s,
        "full_tokens": full[0],
        "full_tokens_per_s": full[0] / full[1] if full[1] else None,  # (None: no step had every slot taken)
        "acceptance_length": 1 + spec_stats.num_accepted_tokens / drafts if policy is not None else None,
        "per_position": [round(n / drafts, 3) for n in spec_stats.num_accepted_tokens_per_pos],
    }
    if policy is not None:
        counts = [n - m for n, m in zip(policy.stats.depth_counts, before, strict=True)]
        row["mean_depth"] = sum(d * n for d, n in enumerate(counts)) / max(sum(counts), 1)
        row["verify_line"] = policy.verify_cost.solve()
    return row


def record(runner, prompts, max_tokens: int, path: Path) -> None:
    """The target's greedy continuations (prompt + output), for the replay drafter."""
    from outrider.target_worker.engine import Engine
    from outrider.target_worker.sequence import RequestParams

    engine = Engine(runner, None, eos_token_id=None, max_batch=len(prompts))
    outputs = engine.generate(prompts, RequestParams(max_tokens=max_tokens + 16, ignore_eos=True))
    path.write_text(json.dumps([p + c.token_ids for p, c in zip(prompts, outputs, strict=True)]))


def runs(batches: list[int], admissions: list[str]) -> list[tuple[int, str]]:
    """(batch, admission) pairs to measure: at batch 1 the two admissions are one (`waves`)."""
    return [(b, a) for b in batches for a in admissions if b > 1 or a == admissions[0]]


def ideal_speedup(acceptance: float, k: int, batch: int, line: tuple[float, ...]) -> float:
    """tau(K) over what verifying K + 1 tokens per sequence costs against 1, from the fitted
    round cost a + b N + u B + j J (`RoundCost`: J, a lone sequence's step to a matrix
    product; the per-drafting-sequence overhead is the engine's, not ideal)."""
    tau = sum(acceptance**i for i in range(k + 1))
    a, b, _, _, u, j = line
    step = j if batch == 1 else 0.0
    return tau * (a + (b + u) * batch) / (a + b * batch * (k + 1) + u * batch + step)


def measure(
    runner, prompts, method, spec, temperature, args, batch: int, admission: str = "waves"
) -> list[dict]:
    """`prompts`: every run's requests, decoded `batch` at a time (`run_once`'s `admission`)."""
    modes = ["plain", *(f"K{k}" for k in FIXED_KS), "adaptive"]
    samples: dict[str, list[dict]] = {m: [] for m in modes}
    policies: dict = {}
    common = (runner, prompts, spec)
    run_lockstep(*common, modes, temperature, args.max_tokens, policies, 0, batch, admission)  # warm-up
    for repeat in range(args.repeats):
        shift = repeat % len(modes)  # (who steps first on ties)
        order = modes[shift:] + modes[:shift]
        run = run_lockstep(
            *common, order, temperature, args.max_tokens, policies, repeat + 1, batch, admission
        )
        for mode in modes:
            samples[mode].append(run[mode])
    plain = [s["tokens_per_s"] for s in samples["plain"]]
    plain_full = [s["full_tokens_per_s"] for s in samples["plain"]]
    line = samples["adaptive"][0]["verify_line"]
    rows = []
    for mode in modes:
        runs = samples[mode]
        row = {
            "method": method if mode != "plain" else "plain",
            "temperature": temperature,
            "batch": batch,
            "admission": admission,
            "requests": len(prompts),
            "mode": mode,
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in runs),
            "speedup_vs_plain": statistics.median(
                r["tokens_per_s"] / p for r, p in zip(runs, plain, strict=True)
            ),
            "full_batch_tokens_per_s": _median(r["full_tokens_per_s"] for r in runs),
            "full_batch_speedup": _median(
                r["full_tokens_per_s"] / p if r["full_tokens_per_s"] and p else None
                for r, p in zip(runs, plain_full, strict=True)
            ),
            "acceptance_length": statistics.median(r["acceptance_length"] for r in runs)
            if mode != "plain"
            else None,
            "per_position_acceptance": runs[0]["per_position"] if mode != "plain" else None,
            "mean_depth": statistics.median(r["mean_depth"] for r in runs) if mode == "adaptive" else None,
        }
        if method.startswith("replay-") and temperature == 0 and mode != "plain":
            acceptance = float(method.split("-")[1])
            ks = FIXED_KS if mode == "adaptive" else (int(mode[1:]),)
            row["ideal_speedup"] = max(ideal_speedup(acceptance, k, batch, line) for k in ks)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", default="ngram,draft_model,replay-0.3,replay-0.5,replay-0.7,replay-0.9")
    parser.add_argument("--temperatures", default="0,1", type=lambda s: [float(t) for t in s.split(",")])
    parser.add_argument("--batches", default="1,16", type=lambda s: [int(b) for b in s.split(",")])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--requests",
        type=int,
        default=16,
        help="requests per run, decoded `batch` at a time (default 16; at least the batch)",
    )
    parser.add_argument(
        "--admission",
        default="waves,continuous",
        type=lambda s: s.split(","),
        help="waves: each `batch` requests start together, the next wait for the last of them; "
        "continuous: a request takes a finished one's slot (3 x batch requests a run, so the batch "
        "stays full but for the end); at batch 1 the two are one (default: both)",
    )
    add_run_arguments(parser, max_tokens=64, prompt_tokens=48)
    args = parser.parse_args(argv)
    if not args.admission or set(args.admission) - set(ADMISSIONS):
        parser.error(f"--admission: a comma-separated list of {', '.join(ADMISSIONS)}")
    torch.set_num_threads(1)

    from outrider.benchmarks.prompts import mid_prompt_ids
    from outrider.benchmarks.replay_drafter import registered
    from outrider.demo.family import ensure_demo_family
    from outrider.target_worker.runner import ModelRunner

    family = ensure_demo_family(args.size)
    most = max(max(args.batches), args.requests)
    most = max(most, 3 * max(args.batches)) if "continuous" in args.admission else most
    prompts = mid_prompt_ids(family.tokenizer_dir, most, args.prompt_tokens)
    context = args.prompt_tokens + args.max_tokens + 2 * CEILING_DEPTH + 16
    runner = ModelRunner.from_pretrained(
        family.target_dir, max_model_len=context, kv_cache_rows=most * context
    )
    rows = []
    with tempfile.TemporaryDirectory() as tmp, registered():
        recording = Path(tmp) / "recording.json"
        record(runner, prompts, args.max_tokens, recording)
        for method in args.methods.split(","):
            spec = specs(method, family, recording)
            temperatures = [0.0] if method.startswith("replay-") else args.temperatures
            for temperature in temperatures:
                for batch, admission in runs(args.batches, args.admission):
                    n = max(batch, args.requests) // batch * batch
                    n = max(n, 3 * batch) if admission == "continuous" else n
                    rows += measure(runner, prompts[:n], method, spec, temperature, args, batch, admission)
    notes = (
        f"Demo family `{args.size}`, `mid` prompts of {args.prompt_tokens} tokens, {args.max_tokens} new tokens "
        f"each, seeded requests ({args.requests} a run, `batch` at a time: `waves`, each `batch` start together and "
        "the next wait for the last of them; `continuous`, 3 x batch a run, a request taking a finished one's slot "
        f"as a server keeps its batch full), in-process drafters, chains, one torch thread; every mode an engine of "
        "its own on the same weights (its own KV cache), all stepped in lockstep (the next step always the one "
        "of whichever engine has spent least time: each meets the same moments of the machine, whose speed "
        f"drifts by ~20% over minutes), {args.repeats} repeats after one unmeasured warm-up (medians; speedups "
        "are ratios to `plain` in the same repeat). `full_batch_*`: over the steps with every slot taken (a "
        "request running or waiting for each of the `batch` slots), leaving out a run's drain: plain decoding "
        "ends a wave's requests in one round (one token each a round), speculation ends them rounds apart "
        "and runs its last rounds below `batch`, where a round's fixed cost is shared by fewer sequences; "
        "a server kept full by its clients has no drain. `K<k>`: every sequence drafts k tokens every round (fixed, vLLM's behaviour); `adaptive`: "
        f"the speculation policy with ceiling {CEILING_DEPTH} (`mean_depth` = its mean chosen depth, 0 = no "
        "draft; one policy per configuration, carried across its runs as in a long-running server). `replay-a`: the target's recorded greedy continuation with each token replaced with "
        "probability 1 - a, at T = 0; `ideal_speedup` = tau(K) x verify(B) / verify(B (K + 1)) from the "
        "verify-cost line the adaptive engine fitted in this run (for `adaptive`, the best fixed K's ideal)."
    )
    write_run_report("policy", rows, args, title="Speculation policy vs fixed K", notes=notes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
