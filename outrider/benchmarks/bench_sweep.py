"""The measurements behind `outrider bench` (see `benchmarks.bench`): sweep, rows, report dict.

One sweep, for each prompt set, temperature, repeat and prompt:

    for name in shuffled(methods + peers):       # a new order for every prompt
        run = generate(name, prompt, seed)       # seeded: every name draws from the same seed
    every engine run goes step by step beside a plain partner (`bench_drafting.lockstep`):
    its ratios to plain (speedup_vs_plain, speedup_paired); plain's run of this prompt is
    the reference for token identity at T = 0 and for the peers

Rows are `bench_drafting.row_for`'s (tokens/s median over prompts, speedup vs plain, tau,
per-position acceptance, looping share, tau on non-looping outputs) plus the counts noise
cannot move and the comparison with the peers.
"""

from __future__ import annotations

import argparse
import itertools
import random
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from outrider.benchmarks.bench import PRIMARY_SET, Models, method_table, resolve_models
from outrider.benchmarks.bench_drafting import (
    Cell,
    Run,
    TimedProposer,
    generate_one,
    repeated_4gram_share,
    row_for,
    sampling_cost,
)
from outrider.proto.gc_heap import freeze_gc_heap

Generate = Callable[[list[int], object], tuple[Run, list[int]]]


def with_budget_policies(table: dict[str, dict | None], policy: str) -> dict[str, dict | None]:
    """Each speculative config as fixed K (its label), adaptive (`<label>+adaptive`), or both."""
    out: dict[str, dict | None] = {}
    for label, config in table.items():
        if config is None:
            out[label] = None
            continue
        if policy in ("fixed", "both"):
            out[label] = {**config, "budget_policy": "fixed"}
        if policy in ("adaptive", "both"):
            out[f"{label}+adaptive" if policy == "both" else label] = {**config, "budget_policy": "adaptive"}
    return out


def engine_runs(
    runner, table: dict[str, dict | None], vocab: int, skipped: list[dict]
) -> dict[str, Generate]:
    """One Engine per config on the shared runner; a config that fails to build is skipped, with why.

    Every run, plain's too (the measurement's own bias: plain against plain), runs in
    `lockstep` with one plain partner Engine on the same weights and a KV cache of its own:
    each run's ratio to plain is measured on the same moments of the machine.

    Prefix caching is off in all of them. The partner runs every prompt once per method, back
    to back, so with it on the partner found 7 of the prompt's 8 blocks cached from its
    previous run (~12 ms of prefill saved) while the method's engine, last used on another
    prompt, computed them all: plain beside plain read ~0.98x. The method engines also share
    one KV cache, which a cached block of one engine cannot survive (another writes its rows)."""
    from outrider.draft_worker import build_proposer
    from outrider.proto import DEFAULT_TREE_BUDGET
    from outrider.target_worker.draft_source import InProcessDraftSource
    from outrider.target_worker.engine import Engine
    from outrider.target_worker.kv_cache import KVCache
    from outrider.target_worker.runner import ModelRunner

    cache = KVCache(runner.model.kv_spec(), runner.cache.total_rows, runner.device)
    partner = Engine(
        ModelRunner(runner.model, cache, runner.max_model_len), None, eos_token_id=None, prefix_caching=False
    )
    turns = itertools.count()  # who steps first, the engine or the partner, alternates run by run
    out: dict[str, Generate] = {}
    for label, config in table.items():
        try:
            source = TimedProposer(build_proposer(config, vocab_size=vocab)) if config else None
        except Exception as e:  # a head that does not fit this target, a bad checkpoint: say so
            skipped.append(
                {"method": config["method"], "label": label, "reason": f"proposer failed to build: {e}"}
            )
            continue
        engine = Engine(
            runner,
            source and InProcessDraftSource(source),
            eos_token_id=None,
            tree_budget=source.proposer.config.budget if source else DEFAULT_TREE_BUDGET,
            budget_policy=(config or {}).get("budget_policy", "fixed"),
            prefix_caching=False,
        )

        def run(prompt, params, engine=engine, source=source):
            return generate_one(engine, source, prompt, params, partner, next(turns) % 2)

        run.engine, run.partner = engine, partner  # for tests
        out[label] = run
    return out


def peer_runs(peers) -> dict[str, Generate]:
    from outrider.kernels import SpecDecodeCounters

    def make(name: str) -> Generate:
        def run(prompt, params):
            r = peers.generate(name, prompt, params.max_tokens, params.temperature, params.seed)
            n, rounds = len(r.tokens), r.target_forwards - 1
            return Run(
                tokens_per_s=n / r.seconds,
                num_tokens=n,
                num_steps=rounds,
                spec=SpecDecodeCounters(),
                draft_s=r.draft_s,
                draft_rounds=rounds if r.draft_s else 0,
                looping=repeated_4gram_share(r.tokens) > 0.5,
                prompt=-1,
                repeat=-1,
            ), r.tokens

        return run

    return {name: make(name) for name in peers.names()}


def sweep(
    runs: dict[str, Generate],
    prompts_by_set: dict,
    temperatures: list[float],
    repeats: int,
    max_tokens: int,
    rng: random.Random,
    log,
) -> tuple[dict, dict]:
    """Cells by (name, set, T), and at T = 0 whether each run's tokens equal plain's."""
    from outrider.target_worker.sequence import RequestParams

    cells: dict[tuple[str, str, float], Cell] = {}
    identical: dict[tuple[str, str, float], list[bool]] = {}
    started = time.perf_counter()
    for prompt_set, prompts in prompts_by_set.items():
        for temperature in temperatures:
            for repeat in range(repeats):
                for i, prompt in enumerate(prompts):
                    params = RequestParams(
                        max_tokens=max_tokens,
                        temperature=temperature,
                        seed=1000 * repeat + i,
                        ignore_eos=True,
                    )
                    order = list(runs)
                    rng.shuffle(order)
                    got = {name: runs[name](prompt.token_ids, params) for name in order}
                    plain, plain_tokens = got["plain"]
                    for name, (run, tokens) in got.items():
                        run.prompt, run.repeat = i, repeat
                        if not run.lockstep:  # a peer: against plain's own run of this prompt
                            run.plain_tokens_per_s = plain.tokens_per_s
                        key = (name, prompt_set, temperature)
                        cells.setdefault(key, Cell()).runs.append(run)
                        if temperature == 0:
                            identical.setdefault(key, []).append(tokens == plain_tokens)
                    log(
                        f"[{time.perf_counter() - started:5.0f}s] {prompt_set} T={temperature:g} repeat {repeat} "
                        f"prompt {i}: " + ", ".join(f"{n} {got[n][0].tokens_per_s:.0f}" for n in runs)
                    )
    return cells, identical


def rows(cells: dict, identical: dict, names: list[str]) -> list[dict]:
    out = []
    for (name, prompt_set, temperature), cell in cells.items():
        row = row_for(name, prompt_set, temperature, cell, cells[("plain", prompt_set, temperature)])
        runs = cell.runs
        seconds = sum(r.num_tokens / r.tokens_per_s for r in runs)
        same = identical.get((name, prompt_set, temperature))
        row |= {
            "target_forwards_per_token": sum(r.num_steps + 1 for r in runs) / sum(r.num_tokens for r in runs),
            "drafter_time_share": sum(r.draft_s for r in runs) / seconds,
            "greedy_identical": sum(same) / len(same) if same else None,
        }
        out.append(row)
    out.sort(
        key=lambda r: (
            r["prompt_set"] != PRIMARY_SET,
            r["prompt_set"],
            r["temperature"],
            names.index(r["method"]),
        )
    )
    return out


def compare(results: list[dict], peers: list[dict]) -> None:
    """Each row's speed against the peers of the same set and temperature (ratios of medians)."""
    by = {(p["name"], p["prompt_set"], p["temperature"]): p["tokens_per_s"] for p in peers}
    for row in results + peers:
        key = (row["prompt_set"], row["temperature"])
        for peer in ("hf-plain", "hf-assisted", "hf-assisted-k4"):
            field = "speedup_vs_" + peer.replace("-", "_")
            theirs = by.get((peer, *key))
            row[field] = row["tokens_per_s"] / theirs if theirs else None


def headline(results: list[dict], temperatures: list[float], prompt_set: str) -> list[dict]:
    lines = []
    for temperature in temperatures:
        candidates = [
            r
            for r in results
            if r["prompt_set"] == prompt_set and r["temperature"] == temperature and r["method"] != "plain"
        ]
        if not candidates:
            continue
        best = max(candidates, key=lambda r: r["speedup_vs_plain"])
        lines.append(
            {
                "prompt_set": prompt_set,
                "temperature": temperature,
                "best_method": best["method"],
                "speedup_vs_plain": best["speedup_vs_plain"],
                "speedup_vs_hf_plain": best["speedup_vs_hf_plain"],
                "speedup_vs_hf_assisted": best["speedup_vs_hf_assisted"],
                "speedup_vs_hf_assisted_k4": best["speedup_vs_hf_assisted_k4"],
            }
        )
    return lines


def tree_table(
    results: list[dict], table: dict, sizes: list[int], prompt_set: str
) -> tuple[str | None, dict]:
    """The best tree-shaped method at T = 0 on `prompt_set`, as a chain and at each tree budget."""
    trees = [
        r
        for r in results
        if r["prompt_set"] == prompt_set and r["temperature"] == 0 and "-tree" in r["method"]
    ]
    if not trees or not sizes:
        return None, {}
    best = max(trees, key=lambda r: r["speedup_vs_plain"])
    base = table[best["method"]]
    out: dict = {"plain": None}
    chain = f"{base['method']}-chain"
    if chain in table:
        out[chain] = table[chain]
    for n in sizes:
        out[f"{base['method']}-tree-{n}"] = {**base, "tree_max_nodes": n}
    return best["method"], out


def tree_nodes(config: dict | None) -> int:
    """Nodes a round verifies at most: the root plus the chain, or the tree budget."""
    if config is None:
        return 1
    return config.get("tree_max_nodes") or config.get("num_speculative_tokens", 1) + 1


def shown(config: dict | None) -> dict | None:
    """A config for the report: model folders by name only (paths differ between machines)."""
    if config is None:
        return None
    return {k: Path(v).name if k == "model" else v for k, v in config.items()}


def run_bench(args: argparse.Namespace, log=print) -> dict:
    from transformers import AutoTokenizer

    from outrider.benchmarks.prompts import load_prompts
    from outrider.benchmarks.report import environment
    from outrider.draft_worker import known_methods
    from outrider.target_worker.runner import ModelRunner

    torch.set_num_threads(args.threads)
    started, phases = time.perf_counter(), {}
    methods = known_methods()
    models: Models = resolve_models(args, methods, log)
    phases["heads_s"] = time.perf_counter() - started
    table = method_table(models, methods)
    if args.methods:
        wanted = {"plain", *args.methods.split(",")}
        table = {k: v for k, v in table.items() if k in wanted}
    table = with_budget_policies(table, args.budget_policy)
    log(f"models ready; building {len(table)} engines and the transformers peers")
    tokenizer = AutoTokenizer.from_pretrained(models.tokenizer_dir)
    context = args.prompt_tokens + args.max_tokens
    runner = ModelRunner.from_pretrained(models.target_dir, max_model_len=context, kv_cache_rows=context + 64)
    vocab = runner.model.vocab_size
    skipped = list(models.skipped)
    runs = engine_runs(runner, table, vocab, skipped)
    names = list(runs)
    peers = None
    if not args.no_peers:
        from outrider.benchmarks.bench_peers import HFPeers

        peers = HFPeers(models.target_dir, models.draft_dir, tokenizer.pad_token_id or tokenizer.eos_token_id)
        runs |= peer_runs(peers)
    sets = args.sets.split(",")
    temperatures = [float(t) for t in args.temperatures.split(",")]
    prompts_by_set = {
        s: load_prompts(s, tokenizer, count=args.prompts, prompt_tokens=args.prompt_tokens) for s in sets
    }
    primary = PRIMARY_SET if PRIMARY_SET in sets else sets[0]
    from outrider.target_worker.sequence import RequestParams

    log(f"prompts ready; warming up {len(runs)} configurations")
    # Lazy initialisation out of the timed runs, and for `+adaptive` configurations the
    # speculation policy's first rounds (it cycles every depth to fit its costs, and learns
    # greedy and sampled requests apart): each engine keeps its policy across the sweep, as a
    # server that has run a while, at every temperature.
    warm = [
        RequestParams(max_tokens=min(64, args.max_tokens), temperature=t, seed=0, ignore_eos=True)
        for t in temperatures
    ]  # within the context
    for run in runs.values():
        for params in warm:
            run(prompts_by_set[primary][0].token_ids, params)
    freeze_gc_heap("bench")  # as the served replicas do once started
    rng = random.Random(args.seed)
    t0 = time.perf_counter()
    cells, identical = sweep(runs, prompts_by_set, temperatures, args.repeats, args.max_tokens, rng, log)
    phases["methods_s"] = time.perf_counter() - t0
    sampling = []
    if "plain" in names and 0.0 in temperatures:  # plain at T > 0 beside plain at T = 0
        plain_run = runs["plain"]
        ids = [p.token_ids for p in prompts_by_set[primary]]
        sampling = [
            {"prompt_set": primary}
            | sampling_cost(plain_run.engine, plain_run.partner, ids, t, args.repeats, args.max_tokens)
            for t in temperatures
            if t > 0
        ]
    all_rows = rows(cells, identical, list(runs))
    results = [r for r in all_rows if r["method"] in names]
    peer_rows = [{"name": r.pop("method"), **r} for r in all_rows if r["method"] not in names]
    compare(results, peer_rows)
    for r in results:
        r["config"] = shown(table[r["method"]])
    for p in peer_rows:
        p["config"] = peers.config(p["name"])

    t0 = time.perf_counter()
    tree_method, tree_configs = tree_table(
        results, table, [int(n) for n in args.tree_sizes.split(",") if n], primary
    )
    tree_rows = []
    if tree_configs:
        tree_runs = engine_runs(runner, tree_configs, vocab, skipped)
        for run in tree_runs.values():
            run(prompts_by_set[primary][0].token_ids, replace(warm[0], temperature=0.0))
        cells, identical = sweep(
            tree_runs, {primary: prompts_by_set[primary]}, [0.0], args.repeats, args.max_tokens, rng, log
        )
        tree_rows = rows(cells, identical, list(tree_runs))
        for r in tree_rows:
            r["tree_nodes"], r["config"] = (
                tree_nodes(tree_configs[r["method"]]),
                shown(tree_configs[r["method"]]),
            )
    phases["tree_sweep_s"] = time.perf_counter() - t0

    lines = headline(results, temperatures, primary)
    serving, serve_method = [], None
    levels = [int(c) for c in args.concurrency.split(",") if c]
    greedy_best = next((line["best_method"] for line in lines if line["temperature"] == 0), None)
    if levels and greedy_best:
        from outrider.benchmarks.bench_serving import bench_serving

        log(f"serving: {serve_method} (best at T=0), concurrency {levels}")
        t0 = time.perf_counter()
        serve_method = greedy_best
        serving = bench_serving(
            models.serve_model,
            models.serve_name,
            table[serve_method],
            [p.token_ids for p in prompts_by_set[primary]],
            concurrencies=levels,
            max_tokens=args.max_tokens,
            max_model_len=context,
            repeats=args.serve_repeats,
            requests_per_level=args.serve_requests,
            seed=args.seed,
            log=log,
        )
        phases["serving_s"] = time.perf_counter() - t0
    phases = {k: round(v, 1) for k, v in phases.items()}
    meta = {
        "command": "outrider bench" + (" --quick" if args.quick else ""),
        "preset": "quick" if args.quick else "full",
        "models": models.label,
        "known_methods": methods,
        "primary_prompt_set": primary,
        "prompt_sets": sets,
        "temperatures": temperatures,
        "prompts_per_set": args.prompts,
        "repeats": args.repeats,
        "prompt_tokens": args.prompt_tokens,
        "max_tokens": args.max_tokens,
        "batch": 1,
        "threads": args.threads,
        "seed": args.seed,
        "tree_sweep_method": tree_method,
        "serving_method": serve_method,
        "serving_config": shown(table.get(serve_method)) if serve_method else None,
        "phases_s": phases,
        "duration_s": round(time.perf_counter() - started, 1),
    }
    return {
        "schema_version": 1,
        "machine": environment(),
        "meta": meta,
        "headline": lines,
        "results": results,
        "peers": peer_rows,
        "skipped": skipped,
        "tree_sweep": tree_rows,
        "serving": serving,
        "sampling_cost": sampling,
    }
