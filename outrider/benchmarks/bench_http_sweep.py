"""Speculation over HTTP against speculation off: the adaptive policy beside fixed K.

    python -m outrider.benchmarks.bench_http_sweep --size small     # benchmarks/results/http_sweep_small.md (committed per run, renamed: http_sweep_small_<method or placement>*.md)
    python -m outrider.benchmarks.bench_http_sweep --size tiny --concurrency 1,4 --ks 2 --methods ngram

One local Ray; `off` (speculation off) is up for the whole run, and for each method in
`--methods` and placement (`colocated`: the drafter in the target replica's process;
`disaggregated`: a draft deployment reached over gRPC) every budget's application is up at
once beside it: `adaptive` (the speculation policy, ceiling max(ks)) and `K<k>` (every
sequence drafts k tokens every round, vLLM's behaviour). At every temperature and
concurrency c each application answers n = max(requests, halves * per_client * c) streamed
`/v1/completions` (c client threads; held-out `mid` prompts as token ids, seeded at T = 1)
in `halves` blocks, in rotation, the order mirrored every other round (off A B C C B A off
off A ...). Each client sends at least `per_client` requests a block, the next as soon as its
last is answered, as vLLM's benchmark keeps c in flight: with one each (c = 16, 16 a block) a
block was one wave whose last rounds ran below c (answers that speculation sped up left the
batch early while off's all ended in the same round; ngram, K = 8, batch 16 in one process:
25 of a wave's 35 rounds ran below 16), a wave's ramp-down rather than concurrency c. On
this 2-core machine throughput drifts by several percent within a minute (the proxy, ingress
and load generator share a core), so every budget is measured inside the same stretch of
time as off and as the others; a speedup is a configuration's output token throughput (over
all its blocks) over off's in the same rotation. A second speculation-off application
(`off-b`, the A/A control; `--no-control` leaves it out) is measured in the rotation as a
configuration: its ratio to off (`control_vs_off`, beside every point) is what a ratio reads
there where nothing differs (a policy that kept speculation off at 99% of its
sequence-rounds read 0.95-1.20x off in one co-located sweep). The target replica being
measured runs on the last core, alone, and everything else on the others (`--no-pin` to let
them move): unpinned, one application drifted by up to 10% from one deployment to the next. Each
application first answers 16 unmeasured requests, 8 at T = 0 and 8 at T = 1 (lazy
initialisation, and the policy's cold start: a long-running server has had them).

Figures carry vLLM's names (its benchmark_serving): output token throughput (completion
tokens / the level's wall time), TTFT, TPOT ((latency - TTFT) / (tokens - 1)), ITL (gaps
between streamed chunks carrying text), median and p99, and the acceptance length and
per-position acceptance from the application's /metrics counters over the level. Beside
them, `full_concurrency_tok_s`: while every client had a request in flight (a block's end,
where speculation's answers leave rounds apart and plain's in one round, left out).
"""

from __future__ import annotations

import argparse
import statistics
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from outrider.benchmarks.bench_serving import app_args, pin_target_replicas, start_local_ray, unpin
from outrider.benchmarks.loadgen import LoadGenerator, percentile
from outrider.benchmarks.report import add_run_arguments, write_run_report

PLACEMENTS = ("colocated", "disaggregated")
OFF = "off"
CONTROL = "off-b"  # a second speculation-off application: the A/A control (`--no-control`: none)


def speculative_config(method: str, budget: str, ks: list[int]) -> dict:
    depth = max(ks) if budget == "adaptive" else int(budget[1:])
    return {
        "method": method,
        "num_speculative_tokens": depth,
        "budget_policy": "adaptive" if budget == "adaptive" else "fixed",
    }


def spec_counters(base: str) -> dict[str, float]:
    """Drafts, accepted tokens and accepted tokens per position, summed over the app's /metrics."""
    with urllib.request.urlopen(f"{base}/metrics", timeout=60) as response:
        page = response.read().decode()
    totals: dict[str, float] = {
        "drafts": 0.0,
        "accepted": 0.0,
        "depth_sum": 0.0,
        "depth_count": 0.0,
        "depth0": 0.0,
    }
    for line in page.splitlines():
        if line.startswith("#"):
            continue
        name, value = line.split("{", 1)[0].split(" ", 1)[0], float(line.rsplit(" ", 1)[1])
        if name == "outrider:spec_decode_num_drafts_total":
            totals["drafts"] += value
        elif name == "outrider:spec_decode_num_accepted_tokens_total":
            totals["accepted"] += value
        elif name == "outrider:spec_decode_draft_depth_sum":
            totals["depth_sum"] += value
        elif name == "outrider:spec_decode_draft_depth_count":
            totals["depth_count"] += value
        elif name == "outrider:spec_decode_draft_depth_bucket" and 'le="0"' in line:
            totals["depth0"] += value
        elif name == "outrider:spec_decode_num_accepted_tokens_per_pos_total":
            position = line.split('position="', 1)[1].split('"', 1)[0]
            totals[f"pos{position}"] = totals.get(f"pos{position}", 0.0) + value
    return totals


def run_block(
    base: str,
    model: str,
    prompts: list[tuple[int, ...]],
    concurrency: int,
    requests: int,
    temperature: float,
    max_tokens: int,
    ignore_eos: bool = False,
    first: int = 0,
) -> tuple[list, float, dict, dict]:
    """`requests` streamed completions (prompts from index `first` on) from `concurrency`
    threads: (records, wall seconds, /metrics counters before, after)."""
    load = LoadGenerator(
        base, model, [], max_tokens, seed=(first + requests) * 1000 + concurrency, ignore_eos=ignore_eos
    )
    before = spec_counters(base)
    started = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        records = list(
            pool.map(
                lambda i: load.request(prompts[i % len(prompts)], stream=True, greedy=temperature == 0),
                range(first, first + requests),
            )
        )
    wall = time.perf_counter() - started
    after = spec_counters(base)
    failed = [r.error for r in records if not r.ok]
    if failed:
        raise RuntimeError(f"{len(failed)} of {requests} requests failed at {base}: {failed[0]}")
    return records, wall, before, after


def run_level(base: str, model: str, prompts: list[tuple[int, ...]], concurrency: int, requests: int,
              temperature: float, max_tokens: int, ignore_eos: bool = False) -> dict:  # fmt: skip
    """`requests` streamed completions from `concurrency` threads: one row's figures."""
    block = run_block(base, model, prompts, concurrency, requests, temperature, max_tokens, ignore_eos)
    return level_figures([block])


def rotated_levels(apps: list[tuple[str, str]], halves: int, pin: bool = False, **level) -> dict[str, dict]:
    """Each of `apps` in `halves` blocks of level["requests"] // halves requests, the order
    mirrored every other round (A B C C B A A B C ...): {who: its figures over its blocks}.
    `pin`: before its block, an application's target replicas get the last core alone."""
    size = level.pop("requests") // halves
    blocks: dict[str, list] = {who: [] for who, _ in apps}
    for half in range(halves):
        for who, url in apps if half % 2 == 0 else apps[::-1]:
            if pin:
                pin_target_replicas(url.rsplit("/", 1)[1])
            blocks[who].append(run_block(url, requests=size, first=half * size, **level))
    return {who: level_figures(runs) for who, runs in blocks.items()}


def measure_level(apps: list[tuple[str, str]], args: argparse.Namespace, flip: bool, model: str,
                  prompts: list[tuple[int, ...]], concurrency: int, temperature: float, pin: bool,
                  ignore_eos: bool) -> tuple[int, dict[str, dict]]:  # fmt: skip
    """One level of `apps` (in reverse order if `flip`) in `args.halves` rotated blocks of at
    least `args.requests` requests in all (and `args.per_client` a client a block): (requests,
    their figures)."""
    n = max(args.requests, args.halves * args.per_client * concurrency) // args.halves * args.halves
    measured = rotated_levels(
        apps[::-1] if flip else apps,
        args.halves,
        pin=pin,
        model=model,
        prompts=prompts,
        concurrency=concurrency,
        requests=n,
        temperature=temperature,
        max_tokens=args.max_tokens,
        ignore_eos=ignore_eos,
    )
    return n, measured


def level_figures(blocks: list[tuple[list, float, dict, dict]]) -> dict:
    """One row's figures over an application's blocks of a level."""
    records = [r for block in blocks for r in block[0]]
    wall = sum(block[1] for block in blocks)
    before: dict[str, float] = {}
    after: dict[str, float] = {}
    for _, _, b, a in blocks:  # counters over the blocks only (not what ran between them)
        for key in a:
            before[key] = before.get(key, 0.0) + b.get(key, 0.0)
            after[key] = after.get(key, 0.0) + a[key]
    tokens = sum(r.tokens for r in records)
    ttft = [1000 * r.ttft_s for r in records if r.ttft_s is not None]
    tpot = [1000 * (r.latency_s - r.ttft_s) / (r.tokens - 1) for r in records if r.tokens > 1 and r.ttft_s]
    itl = [1000 * gap for r in records for gap in r.itl_s]
    drafts = after["drafts"] - before["drafts"]
    positions = sorted((int(k[3:]), after[k] - before.get(k, 0.0)) for k in after if k.startswith("pos"))
    rounds = after.get("depth_count", 0.0) - before.get("depth_count", 0.0)
    return {
        "output_tok_s": tokens / wall,
        "full_concurrency_tok_s": full_concurrency_rate([block[0] for block in blocks]),
        "ttft_ms_median": statistics.median(ttft),
        "ttft_ms_p99": percentile(ttft, 0.99),
        "tpot_ms_median": statistics.median(tpot) if tpot else None,
        "tpot_ms_p99": percentile(tpot, 0.99),
        "itl_ms_median": statistics.median(itl) if itl else None,
        "itl_ms_p99": percentile(itl, 0.99),
        "acceptance_length": 1 + (after["accepted"] - before["accepted"]) / drafts if drafts else None,
        "per_position_acceptance": [round(n / drafts, 3) for _, n in positions if n] if drafts else None,
        # The policy's budgets over the level's sequence-rounds: mean depth, and the share at 0.
        "mean_budget_depth": (after["depth_sum"] - before.get("depth_sum", 0.0)) / rounds if rounds else None,
        "budget_off_share": (after["depth0"] - before.get("depth0", 0.0)) / rounds if rounds else None,
    }


def full_concurrency_rate(blocks: list[list]) -> float | None:
    """Output tokens a second while every client had a request in flight: in each block, from
    its first request's start to its last's (after it, answers leave and none replace them),
    counted from the usage every chunk carries (`RequestRecord.token_times`). None where a
    block has no such stretch (one wave) or chunks came without usage."""
    tokens, seconds = 0, 0.0
    for records in blocks:
        first, last = min(r.start for r in records), max(r.start for r in records)
        if last <= first or not all(r.token_times for r in records):
            return None
        seconds += last - first
        tokens += sum(max((n for t, n in r.token_times if t <= last), default=0) for r in records)
    return tokens / seconds if seconds else None


def sweep(args: argparse.Namespace, log=print) -> list[dict]:
    import ray
    from ray import serve

    from outrider.benchmarks.prompts import mid_prompt_ids
    from outrider.cluster.app import build_app
    from outrider.demo.family import ensure_demo_family

    family = ensure_demo_family(args.size, progress=False, log=log)
    prompts = [tuple(p) for p in mid_prompt_ids(family.tokenizer_dir, args.prompts, args.prompt_tokens)]
    context = args.prompt_tokens + args.max_tokens + 16
    model, name = {"demo": args.size}, f"outrider-demo-{args.size}"
    levels = [(t, c) for t in args.temperatures for c in args.concurrency]
    seqs = max(2, *args.concurrency)  # (the warm-up runs 2 at a time)

    def deploy(label: str, spec: dict | None, placement: str) -> str:
        variant = OFF if spec is None else placement
        app = app_args(variant, model, spec or {}, context)
        app["engine"]["max_num_seqs"] = seqs
        app["engine"]["max_queued_requests"] = seqs
        serve.run(build_app(app), name=label, route_prefix=f"/{label}")
        base = f"http://127.0.0.1:{port}/{label}"
        # Warm-up, unmeasured: lazy initialisation, first compiles, and the speculation policy's
        # first rounds, as a server that has run: it cycles every depth to fit its costs, and
        # until it has seen what its probes find it spaces them by their cost alone. With 4
        # short requests that cold start fell in the first level measured (ngram, T = 0, c = 1:
        # in one process the policy stayed off through about five whole requests after them,
        # 0.79-0.86x fixed K = 8, then drafted as K = 8 did).
        for temperature in (0.0, 1.0):
            run_level(base, name, prompts, 2, 8, temperature, args.max_tokens, args.ignore_eos)
        return base

    port = start_local_ray(pin=args.pin)
    rows: list[dict] = []
    budgets = ["adaptive", *(f"K{k}" for k in args.ks)]
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        off = deploy(OFF, None, "")
        control = [(CONTROL, deploy(CONTROL, None, ""))] if args.control else []
        for index, (method, placement) in enumerate((m, p) for m in args.methods for p in args.placements):
            started = time.perf_counter()
            apps = [(OFF, off), *control]
            for budget in budgets:
                label = f"{method}-{placement}-{budget}"
                apps.append((budget, deploy(label, speculative_config(method, budget, args.ks), placement)))
            log(f"[{index + 1}] {method} {placement}: {len(budgets)} applications up in "
                f"{time.perf_counter() - started:.0f} s")  # fmt: skip
            for j, (temperature, concurrency) in enumerate(levels):
                n, measured = measure_level(
                    apps,
                    args,
                    (index + j) % 2 == 1,
                    name,
                    prompts,
                    concurrency,
                    temperature,
                    args.pin,
                    args.ignore_eos,
                )
                common = {"temperature": temperature, "concurrency": concurrency, "requests": n}
                rows.append({"method": OFF, "placement": "—", "budget": "—", **common, **measured[OFF]})
                base_tok_s = measured[OFF]["output_tok_s"]
                # The same speculation-off server measured as a configuration: what a ratio to
                # off reads where nothing differs (the point's noise), beside every row of it.
                aa = {}
                if control:
                    aa["control_vs_off"] = measured[CONTROL]["output_tok_s"] / base_tok_s
                    aa["control_full_concurrency"] = full_ratio(measured[CONTROL], measured[OFF])
                    control_row = {"method": CONTROL, "placement": "—", "budget": "—", **common}
                    rows.append({**control_row, **measured[CONTROL], "speedup_vs_off": aa["control_vs_off"]})
                for budget in budgets:
                    rows.append(
                        {
                            "method": method,
                            "placement": placement,
                            "budget": budget,
                            **common,
                            **measured[budget],
                            "speedup_vs_off": measured[budget]["output_tok_s"] / base_tok_s,
                            "full_concurrency_speedup": full_ratio(measured[budget], measured[OFF]),
                            **aa,
                        }
                    )
                log(
                    f"    T={temperature:g} c={concurrency}: off {base_tok_s:.0f} tok/s; "
                    + ", ".join(f"{b} {measured[b]['output_tok_s'] / base_tok_s:.2f}x" for b in budgets)
                    + (f"; {CONTROL} (A/A) {aa['control_vs_off']:.2f}x" if control else "")
                )
            for budget in budgets:
                serve.delete(f"{method}-{placement}-{budget}")
    finally:
        serve.shutdown()
        ray.shutdown()
        unpin()
    return rows


def full_ratio(figures: dict, off: dict) -> float | None:
    """`full_concurrency_tok_s` over off's, where both were measured."""
    a, b = figures["full_concurrency_tok_s"], off["full_concurrency_tok_s"]
    return a / b if a and b else None


def summary(rows: list[dict]) -> list[dict]:
    """Per (method, placement, temperature, concurrency): adaptive, the best fixed K, and off,
    over whole blocks and (`full_*`) while every client had a request in flight."""
    cells: dict[tuple, dict] = {}
    controls: dict[tuple, tuple] = {}
    for row in rows:
        if row["method"] in (OFF, CONTROL):
            continue
        key = (row["method"], row["placement"], row["temperature"], row["concurrency"])
        cells.setdefault(key, {})[row["budget"]] = (
            row["speedup_vs_off"],
            row.get("full_concurrency_speedup"),
        )
        controls[key] = (row.get("control_vs_off"), row.get("control_full_concurrency"))
    out = []
    for key, by_budget in cells.items():
        method, placement, temperature, concurrency = key
        cell = {"method": method, "placement": placement, "temperature": temperature}
        cell["concurrency"] = concurrency
        for i, prefix in enumerate(("", "full_")):
            speedups = {b: s[i] for b, s in by_budget.items()}
            fixed = {b: s for b, s in speedups.items() if b != "adaptive" and s is not None}
            best = max(fixed, key=fixed.get) if fixed else None
            adaptive = speedups.get("adaptive")
            cell |= {
                f"{prefix}adaptive_vs_off": adaptive,
                f"{prefix}best_fixed": best,
                f"{prefix}best_fixed_vs_off": fixed.get(best),
                f"{prefix}adaptive_vs_best_fixed": adaptive / fixed[best] if adaptive and best else None,
                f"{prefix}control_vs_off": controls[key][i],
            }
        out.append(cell)
    return out


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def level_parser(doc: str) -> argparse.ArgumentParser:
    """The arguments every HTTP benchmark of rotated levels takes (`measure_level`): lengths,
    report folder, concurrencies, requests and blocks per level, prompts; `doc`'s first
    paragraph is the description."""
    parser = argparse.ArgumentParser(
        description=doc.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_run_arguments(parser, max_tokens=64, prompt_tokens=64)
    parser.add_argument("--concurrency", type=_ints, default=[1, 4, 16, 64], help="default: 1,4,16,64")
    parser.add_argument(
        "--requests",
        type=int,
        default=64,
        help="requests per application and level, at least halves x per-client x c (default 64: at "
        "16, a level at c = 4 measured each application for ~1 s, in blocks of half a second)",
    )
    parser.add_argument(
        "--halves",
        type=int,
        default=2,
        help="blocks each application's requests run in, in rotation, mirrored every other round "
        "(A B C C B A ...); 1: one block each (default: 2)",
    )
    parser.add_argument(
        "--per-client",
        type=int,
        default=2,
        help="requests each client sends at least per block (default 2: with 1, a block at c = 16 "
        "or 64 is one wave, most of whose rounds run below c as its answers finish apart)",
    )
    parser.add_argument("--prompts", type=int, default=32, help="distinct held-out prompts")
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = level_parser(__doc__)
    parser.add_argument("--temperatures", type=lambda s: [float(x) for x in s.split(",")], default=[0.0, 1.0])
    parser.add_argument("--methods", type=lambda s: s.split(","), default=["ngram", "draft_model"])
    parser.add_argument("--placements", type=lambda s: s.split(","), default=list(PLACEMENTS))
    parser.add_argument(
        "--ks", type=_ints, default=[1, 2, 4, 8], help="fixed K to compare (default: 1,2,4,8)"
    )
    parser.add_argument(
        "--ignore-eos",
        action="store_true",
        help="every answer runs to --max-tokens (as vLLM's benchmark): at T = 1 answers that stop "
        "at EOS at different lengths in the two applications weigh each request's TTFT differently",
    )
    parser.add_argument(
        "--no-control",
        dest="control",
        action="store_false",
        help=f"leave out the A/A control: by default a second speculation-off application ({CONTROL}) "
        "is measured in every rotation like a configuration, and each point reports its ratio to off "
        "(`control_vs_off`): what that point's ratios read where nothing differs",
    )
    parser.add_argument(
        "--no-pin",
        dest="pin",
        action="store_false",
        help="leave every process free to move between cores (by default the target replicas run "
        "on the last core, alone, and everything else on the others: see bench_serving.pin_target_replicas)",
    )
    args = parser.parse_args(argv)
    if args.halves < 1 or args.per_client < 1:
        parser.error("--halves and --per-client must be at least 1")
    for placement in args.placements:
        if placement not in PLACEMENTS:
            parser.error(f"unknown placement {placement!r}; use {', '.join(PLACEMENTS)}")
    rows = sweep(args)
    notes = __doc__.split("\n\n", 2)[2]
    write_run_report(
        "http_sweep", rows, args, title="Speculation over HTTP: adaptive vs fixed K vs off", notes=notes
    )
    args_summary = argparse.Namespace(**{**vars(args), "size": f"{args.size}_summary"})
    write_run_report(
        "http_sweep",
        summary(rows),
        args_summary,
        title="Speculation over HTTP: summary (speedups over off measured beside each configuration)",
        notes="Adaptive and the best of the fixed K at each point; the rows are in http_sweep_<size>.md.",
    )


if __name__ == "__main__":
    main()
