"""Drafting methods through the step engine: acceptance, drafter cost and speedup over plain.

    python -m outrider.benchmarks.bench_drafting --size small          # the issue's setting
    python -m outrider.benchmarks.bench_drafting --size tiny --prompts 2 --repeats 1   # a quick look

Batch 1, held-out prompts (`mid`, the primary set, and `start`), 128 new tokens, T = 0 and
T = 1 (seeded, the same seed for every method), EOS ignored. For each prompt every method
runs back to back in a rotating order, and the whole sweep repeats: absolute tokens/s on
these shared machines drift 15-25% over minutes, interleaved ratios do not. Figures:

    tokens_per_s          median over prompts of each prompt's median over repeats
    speedup_vs_plain      that median / plain's median (same run, same prompts)
    speedup_paired        median of per-run ratios against the plain run next to it
    (`outrider bench` runs every method beside a plain partner, step by step (`lockstep`):
    there both ratios are against that partner, speedup_vs_plain pooled over the runs)
    acceptance_length     tau, vLLM's: 1 + accepted / drafts (steps that had a draft)
    tokens_per_step       output tokens / target forwards after the prompt (undrafted steps too)
    accept_per_pos        share of drafts whose position i was accepted (vLLM's per-position)
    draft_ms_per_round    drafter wall time per round (`propose` for the whole batch)
    looping_share         outputs with > 50% repeated 4-grams (docs/algorithms.md section 9)
    tau_non_looping       tau over the other outputs only; loops inflate acceptance
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from outrider.kernels import SpecDecodeCounters
from outrider.proto import CandidateTree, FeatureSpec, SequenceUpdate


def method_configs(draft_dir: str, heads: dict[str, str] | None = None) -> dict[str, dict | None]:
    """Method name (registry name first) -> speculative config; None = plain decoding.

    `heads`: the demo family's trained heads by method (`draft_worker.training.demo_heads`), benchmarked too.
    """
    model = {"method": "draft_model", "model": draft_dir}
    learned = {}
    tree = {"tree_top_k": 3, "tree_max_nodes": 12}
    for method, folder in (heads or {}).items():
        if method not in ("eagle3", "peagle"):
            continue
        head = {"method": method, "model": folder}
        learned[f"{method}-chain"] = {**head, "num_speculative_tokens": 4}
        learned[f"{method}-tree"] = {**head, "num_speculative_tokens": 5, **tree}
    return learned | {
        "plain": None,
        "ngram": {
            "method": "ngram",
            "num_speculative_tokens": 4,
            "prompt_lookup_min": 2,
            "prompt_lookup_max": 4,
        },
        "suffix": {"method": "suffix", "num_speculative_tokens": 6, "tree_top_k": 3, "tree_max_nodes": 12},
        "draft_model-chain": {**model, "num_speculative_tokens": 4},
        "draft_model-tree": {**model, "num_speculative_tokens": 5, "tree_top_k": 3, "tree_max_nodes": 12},
    }


class TimedProposer:
    """Wraps a proposer for `InProcessDraftSource`, timing each round's `propose`."""

    def __init__(self, proposer):
        self.proposer, self.seconds, self.rounds = proposer, 0.0, 0

    @property
    def feature_spec(self) -> FeatureSpec:
        return self.proposer.feature_spec

    def propose(self, updates: Sequence[SequenceUpdate]) -> list[CandidateTree]:
        started = time.perf_counter()
        trees = self.proposer.propose(updates)
        self.seconds += time.perf_counter() - started
        self.rounds += any(not u.finished for u in updates)
        return trees


def repeated_4gram_share(tokens: list[int]) -> float:
    grams = [tuple(tokens[i : i + 4]) for i in range(len(tokens) - 3)]
    return 1 - len(set(grams)) / len(grams) if grams else 0.0


@dataclass
class Run:
    """One generation: one method, one prompt, one repeat."""

    tokens_per_s: float
    num_tokens: int
    num_steps: int  # target forwards after the prompt's
    spec: SpecDecodeCounters
    draft_s: float
    draft_rounds: int
    looping: bool
    prompt: int
    repeat: int
    plain_tokens_per_s: float | None = None  # the plain run of the same prompt and repeat
    lockstep: bool = False  # that plain run ran beside this one, step by step (`lockstep`)


@dataclass
class Cell:
    """All runs of one (method, prompt set, temperature)."""

    runs: list[Run] = field(default_factory=list)

    def median_tokens_per_s(self) -> float:
        prompts = sorted({r.prompt for r in self.runs})
        return statistics.median(
            statistics.median(r.tokens_per_s for r in self.runs if r.prompt == p) for p in prompts
        )


def merged(runs: list[Run]) -> SpecDecodeCounters:
    total = SpecDecodeCounters()
    for run in runs:
        total.merge(run.spec)
    return total


def tau(counters: SpecDecodeCounters) -> float | None:
    return 1 + counters.num_accepted_tokens / counters.num_drafts if counters.num_drafts else None


def lockstep(engines: Sequence, prompt: list[int], params, first: int = 0) -> list[tuple[list[int], float]]:
    """One request on each engine (each with its own KV cache), a step at a time, always
    stepping the engine whose steps have taken least time so far (ties: from `first` on);
    per engine, its tokens and the seconds its own steps took. `params`: one RequestParams for
    all, or a list, one per engine.

    Whoever steps first meets the caches as the last run left them; callers alternate it.
    Both engines must meet the prompt alike: with prefix caching on, a partner that ran this
    prompt the run before skips most of its prefill and plain beside plain read ~0.98x
    (`bench_sweep.engine_runs` turns it off); the report shows that control.

    Measured on this 2-core machine: a decode step's time varies ~16% (its lag-1
    autocorrelation 0.72, gone by ~100 steps), so two requests run one after the other see
    different machines, ~10% apart per 128-token pair. Interleaved step by step they see the
    same one: plain against plain, per-pair ratios within ~1.5%."""
    each = params if isinstance(params, list | tuple) else [params] * len(engines)
    ids = [engine.add_request(prompt, p) for engine, p in zip(engines, each, strict=True)]
    tokens: list[list[int]] = [[] for _ in engines]
    spent = [0.0] * len(engines)
    live = list(range(first, len(engines))) + list(range(first))
    while live:
        i = min(live, key=spent.__getitem__)
        started = time.perf_counter()
        outputs = engines[i].step()
        spent[i] += time.perf_counter() - started
        tokens[i] += [t for o in outputs if o.request_id == ids[i] for t in o.new_token_ids]
        if not engines[i].has_unfinished():
            live.remove(i)
    return list(zip(tokens, spent, strict=True))


def sampling_cost(
    engine, partner, prompts: list[list[int]], temperature: float, repeats: int, max_tokens: int
) -> dict:
    """Plain decoding at `temperature` beside plain decoding at T = 0, in `lockstep` (two
    plain engines, their own KV caches): what sampling costs, measured on the same moments of
    the machine, not as medians of runs taken minutes apart. Seeds as the sweep's."""
    from dataclasses import replace

    from outrider.target_worker.sequence import RequestParams

    ratios, totals = [], [[0, 0.0], [0, 0.0]]  # [tokens, seconds]: sampled, greedy
    for repeat in range(repeats):
        for i, prompt in enumerate(prompts):
            sampled = RequestParams(
                max_tokens=max_tokens, temperature=temperature, seed=1000 * repeat + i, ignore_eos=True
            )
            pair = lockstep([engine, partner], prompt, [sampled, replace(sampled, temperature=0.0)], i % 2)
            for total, (tokens, seconds) in zip(totals, pair, strict=True):
                total[0] += len(tokens)
                total[1] += seconds
            (sampled_tokens, sampled_s), (greedy_tokens, greedy_s) = pair
            ratios.append((len(sampled_tokens) / sampled_s) / (len(greedy_tokens) / greedy_s))
    (n_sampled, s_sampled), (n_greedy, s_greedy) = totals
    return {
        "temperature": temperature,
        "speedup_vs_greedy": (n_sampled / s_sampled) / (n_greedy / s_greedy),
        "speedup_paired": statistics.median(ratios),
        "runs": len(ratios),
    }


def generate_one(
    engine, source: TimedProposer | None, prompt: list[int], params, partner=None, first: int = 0
) -> tuple[Run, list[int]]:
    """One request on `engine`: its Run and tokens. With a `partner` (a plain Engine of its
    own), the two run in `lockstep` (`first`: 0, the engine steps first; 1, the partner) and
    the Run's `plain_tokens_per_s` is the partner's."""
    from outrider.target_worker.engine import EngineStats

    engine.stats = EngineStats()
    if source is not None:
        source.seconds, source.rounds = 0.0, 0
    plain_tokens_per_s = None
    if partner is None:
        started = time.perf_counter()
        tokens = engine.generate([prompt], params)[0].token_ids
        elapsed = time.perf_counter() - started
    else:
        (tokens, elapsed), (plain_tokens, plain_s) = lockstep([engine, partner], prompt, params, first)
        plain_tokens_per_s = len(plain_tokens) / plain_s
    run = Run(
        tokens_per_s=len(tokens) / elapsed,
        num_tokens=len(tokens),
        num_steps=engine.stats.num_rounds - 1,  # the first forward is the prompt's
        spec=engine.stats.spec,
        draft_s=source.seconds if source else 0.0,
        draft_rounds=source.rounds if source else 0,
        looping=repeated_4gram_share(tokens) > 0.5,
        prompt=-1,
        repeat=-1,
        plain_tokens_per_s=plain_tokens_per_s,
        lockstep=partner is not None,
    )
    return run, tokens


def row_for(method: str, prompt_set: str, temperature: float, cell: Cell, plain: Cell) -> dict:
    from outrider.benchmarks.report import DecodeRow

    runs = cell.runs
    counters = merged(runs)
    per_pos = (
        [n / counters.num_drafts for n in counters.num_accepted_tokens_per_pos] if counters.num_drafts else []
    )
    non_looping = [r for r in runs if not r.looping]
    speed = cell.median_tokens_per_s()
    if cell is plain:  # plain itself; its speedup_paired, against its partner, is the control
        speedup = 1.0
    elif all(r.lockstep for r in runs):  # the time plain took beside each run, over the run's own
        speedup = sum(r.num_tokens / r.plain_tokens_per_s for r in runs) / sum(
            r.num_tokens / r.tokens_per_s for r in runs
        )
    else:
        speedup = speed / plain.median_tokens_per_s()
    draft_rounds = sum(r.draft_rounds for r in runs)
    return DecodeRow(
        method=method,
        prompt_set=prompt_set,
        temperature=temperature,
        tokens_per_s=speed,
        speedup_vs_plain=speedup,
        acceptance_length=tau(counters),
        extra={
            "speedup_paired": statistics.median(r.tokens_per_s / r.plain_tokens_per_s for r in runs),
            "tokens_per_step": sum(r.num_tokens - 1 for r in runs) / max(sum(r.num_steps for r in runs), 1),
            "accept_per_pos": [round(x, 3) for x in per_pos],
            "draft_ms_per_round": 1000 * sum(r.draft_s for r in runs) / draft_rounds
            if draft_rounds
            else None,
            "looping_share": sum(r.looping for r in runs) / len(runs),
            "tau_non_looping": tau(merged(non_looping)),
            "runs": len(runs),
        },
    ).to_dict()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="small", help="demo family (default: %(default)s)")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per set (default: %(default)s)")
    parser.add_argument(
        "--repeats", type=int, default=2, help="sweeps over all prompts (default: %(default)s)"
    )
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--sets", default="mid,start")
    parser.add_argument("--temperatures", default="0,1")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads; 2 spin against each other on a shared 2-core box",
    )
    parser.add_argument("--name", default=None, help="report name (default: bench_drafting_<size>)")
    parser.add_argument(
        "--methods", default=None, help="comma-separated subset of the methods (plain is always run)"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    from transformers import AutoTokenizer

    import outrider.draft_worker.draft_model  # noqa: F401 - registers `draft_model`
    from outrider.benchmarks.prompts import load_prompts
    from outrider.benchmarks.report import write_report
    from outrider.demo.family import ensure_demo_family
    from outrider.draft_worker import build_proposer
    from outrider.target_worker.draft_source import InProcessDraftSource
    from outrider.target_worker.engine import Engine
    from outrider.target_worker.runner import ModelRunner
    from outrider.target_worker.sequence import RequestParams

    family = ensure_demo_family(args.size)
    tokenizer = AutoTokenizer.from_pretrained(family.tokenizer_dir)
    # One target runner shared by every engine: same weights, same cache, runs never overlap.
    context = args.prompt_tokens + args.max_tokens
    runner = ModelRunner.from_pretrained(family.target_dir, max_model_len=context, kv_cache_rows=context + 64)
    vocab = runner.model.vocab_size
    engines: dict[str, tuple[Engine, TimedProposer | None]] = {}
    from outrider.draft_worker.training.demo_heads import demo_head_dir, head_methods

    heads = {m: str(demo_head_dir(family, m)) for m in ("eagle3", "peagle") if m in head_methods()}
    configs = method_configs(str(family.draft_dir), heads)
    if args.methods:
        wanted = {"plain", *args.methods.split(",")}
        configs = {m: c for m, c in configs.items() if m in wanted}
    for method, config in configs.items():
        source = TimedProposer(build_proposer(config, vocab_size=vocab)) if config else None
        engines[method] = (Engine(runner, source and InProcessDraftSource(source), eos_token_id=None), source)

    cells: dict[tuple[str, str, float], Cell] = {}
    started = time.perf_counter()
    for prompt_set in args.sets.split(","):
        prompts = load_prompts(prompt_set, tokenizer, count=args.prompts, prompt_tokens=args.prompt_tokens)
        for temperature in (float(t) for t in args.temperatures.split(",")):
            for repeat in range(args.repeats):
                for i, prompt in enumerate(prompts):
                    seed = 1000 * repeat + i
                    params = RequestParams(
                        max_tokens=args.max_tokens, temperature=temperature, seed=seed, ignore_eos=True
                    )
                    names = list(engines)
                    shift = (i + repeat) % len(names)  # rotate who runs first (warm caches, drift)
                    runs = {}
                    for method in names[shift:] + names[:shift]:
                        engine, source = engines[method]
                        runs[method], _ = generate_one(engine, source, prompt.token_ids, params)
                        runs[method].prompt, runs[method].repeat = i, repeat
                    for method, run in runs.items():
                        run.plain_tokens_per_s = runs["plain"].tokens_per_s
                        cells.setdefault((method, prompt_set, temperature), Cell()).runs.append(run)
                    print(
                        f"[{time.perf_counter() - started:6.0f}s] {prompt_set} T={temperature:g} "
                        f"repeat {repeat} prompt {i}: "
                        + ", ".join(f"{m} {r.tokens_per_s:.0f}" for m, r in runs.items()),
                        flush=True,
                    )

    rows = [
        row_for(method, prompt_set, temperature, cell, cells[("plain", prompt_set, temperature)])
        for (method, prompt_set, temperature), cell in cells.items()
    ]
    rows.sort(key=lambda r: (r["prompt_set"] != "mid", r["temperature"], list(engines).index(r["method"])))
    meta = {
        "size": args.size,
        "family": family.root.name,
        "prompts_per_set": args.prompts,
        "repeats": args.repeats,
        "prompt_tokens": args.prompt_tokens,
        "max_tokens": args.max_tokens,
        "batch": 1,
        "configs": {m: c and {**c, "model": "<demo>"} for m, c in configs.items()},
        "wall_s": round(time.perf_counter() - started),
    }
    notes = (
        f"Demo family `{args.size}`, batch 1, {args.prompts} held-out prompts per set x {args.repeats} "
        f"repeats, {args.prompt_tokens}-token prompts, {args.max_tokens} new tokens (EOS ignored), "
        "in-process drafting (drafter time is on the critical path). Methods run interleaved per "
        "prompt in a rotating order on a shared, noisy machine: read the speedups (ratios within "
        "one run), not absolute tokens/s. `mid` (mid-file code) is the primary set; `start` "
        "(file starts) loops more, and loops inflate acceptance: see looping_share and "
        "tau_non_looping. At T = 0 every method emits the same tokens as plain decoding, so "
        "looping_share is the same for all methods there."
    )
    columns = [
        "method",
        "prompt_set",
        "temperature",
        "tokens_per_s",
        "speedup_vs_plain",
        "speedup_paired",
        "acceptance_length",
        "tokens_per_step",
        "accept_per_pos",
        "draft_ms_per_round",
        "looping_share",
        "tau_non_looping",
    ]
    name = args.name or f"bench_drafting_{args.size}"
    json_path, md_path = write_report(
        name, rows, meta, title=f"Drafting methods ({args.size} demo family)", notes=notes, columns=columns
    )
    print(md_path.read_text())
    print(f"wrote {json_path} and {md_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
