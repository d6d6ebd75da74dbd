"""`outrider bench`: every drafting method against plain decoding and `transformers`, in one run.

    outrider bench --quick --json out.json      # tiny family, every path, under 3 minutes
    outrider bench                              # the small demo family (benchmarks/results/bench_small.*)
    outrider bench --model DIR --draft DIR --head eagle3=DIR   # your own checkpoints

What runs, on one machine, in one process (serving: one local Ray):

1. Methods: plain decoding and every method `draft_worker.known_methods()` lists, as chain
   and tree shapes (`bench_drafting.method_configs`, `bench_medusa.medusa_configs`, and
   `mtp` below), on held-out `mid` (mid-file code, the primary set) and `start` (file
   starts) prompts, at T = 0 and T = 1. A method whose head is missing or fails to build is
   listed under `skipped` with the reason, never dropped.
2. Peers: `transformers` generate() plain, assisted (the same draft LM) and prompt lookup
   (`bench_peers`), inside the same sweep.
3. Timing: for each prompt every configuration (methods and peers) runs once, in a shuffled
   order, and the sweep repeats; speedups are ratios within this run. Counts that noise
   cannot move are reported beside them: target forwards per output token, and at T = 0
   the share of outputs token-identical to plain greedy decoding.
4. Tree sizes: the best tree method at T = 0 on the primary set, at several tree budgets.
5. Serving: the Ray Serve app over HTTP, speculation off / co-located / disaggregated, at
   several concurrencies (`bench_serving`).

Writes the JSON (schema: `bench_schema.SCHEMA`, documented in benchmarks/README.md), a
Markdown report and PNG plots beside it (`bench_render`).
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from outrider.benchmarks.report import RESULTS_DIR

PRIMARY_SET = "mid"
# --quick and full-run defaults; any option given on the command line wins.
PRESETS = {
    "quick": {
        "size": "tiny",
        "prompts": 2,
        "repeats": 1,
        "max_tokens": 24,
        "prompt_tokens": 48,
        "tree_sizes": "8",
        "budget_policy": "adaptive",
        "concurrency": "1",
        "serve_requests": 2,
        "serve_repeats": 1,
    },
    "full": {
        "size": "small",
        "prompts": 5,
        "repeats": 2,
        "max_tokens": 128,
        "prompt_tokens": 128,
        "tree_sizes": "4,8,16,32",
        "budget_policy": "both",
        "concurrency": "1,4,16",
        "serve_requests": 8,
        "serve_repeats": 2,
    },
}


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--quick",
        action="store_true",
        help="tiny family, 2 prompts, 24 tokens, concurrency 1: every path in under 3 minutes",
    )
    parser.add_argument(
        "--json",
        metavar="PATH",
        help="the JSON report; the .md and .png files go beside it (default: bench_<size>.json in "
        "benchmarks/results/ of a checkout, else in the working directory)",
    )
    parser.add_argument(
        "--size", choices=("tiny", "small"), help="demo family (default: small; tiny with --quick)"
    )
    parser.add_argument(
        "--model", metavar="DIR", help="a target checkpoint folder (HF layout) instead of the demo target"
    )
    parser.add_argument(
        "--draft",
        metavar="DIR",
        help="with --model: the draft LM for draft_model and transformers' assisted generation",
    )
    parser.add_argument(
        "--tokenizer", metavar="DIR", help="with --model: tokenizer folder (default: the model folder)"
    )
    parser.add_argument(
        "--head",
        action="append",
        default=[],
        metavar="METHOD=DIR",
        help="a trained head for a method (eagle3, peagle, medusa, mtp); repeatable",
    )
    parser.add_argument(
        "--no-build-heads",
        action="store_true",
        help="demo family: skip methods whose head is not built yet instead of training it",
    )
    parser.add_argument(
        "--prompts", type=positive, help="held-out prompts per set (default: 5; 2 with --quick)"
    )
    parser.add_argument(
        "--repeats", type=positive, help="sweeps over all prompts (default: 2; 1 with --quick)"
    )
    parser.add_argument(
        "--max-tokens",
        type=positive,
        help="new tokens per request, EOS ignored (default: 128; 24 with --quick)",
    )
    parser.add_argument(
        "--prompt-tokens", type=positive, help="prompt length in tokens (default: 128; 48 with --quick)"
    )
    parser.add_argument(
        "--sets", default="mid,start", help="prompt sets (default: %(default)s; mid is the primary set)"
    )
    parser.add_argument("--temperatures", default="0,1", help="(default: %(default)s)")
    parser.add_argument("--methods", help="comma-separated subset of method labels (plain is always run)")
    parser.add_argument(
        "--budget-policy",
        choices=("adaptive", "fixed", "both"),
        help="how each method's drafts are sized: the speculation policy (label suffix `+adaptive`), "
        "its fixed K every round, or both side by side (default: both; adaptive with --quick)",
    )
    parser.add_argument(
        "--tree-sizes",
        type=positive_list,
        help="tree budgets (max nodes) for the tree-size sweep; empty = none (default: 4,8,16,32)",
    )
    parser.add_argument(
        "--concurrency",
        type=positive_list,
        help="serving concurrency levels; empty = no serving (default: 1,4,16)",
    )
    parser.add_argument(
        "--serve-requests", type=positive, help="requests per level and variant (at least the concurrency)"
    )
    parser.add_argument("--serve-repeats", type=positive, help="repeats of the serving sweep")
    parser.add_argument("--no-peers", action="store_true", help="skip the transformers peers")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default: %(default)s)")
    parser.add_argument(
        "--seed", type=int, default=0, help="order shuffling and sampling seeds (default: %(default)s)"
    )
    parser.add_argument("--schema", action="store_true", help="print the JSON schema of the report and exit")


def positive(text: str) -> int:
    """An argument that must be a whole number >= 1 (an error before anything runs, not after)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not at least 1")
    return value


def positive_list(text: str) -> str:
    """Comma-separated whole numbers >= 1, or empty (kept as given: `bench_sweep` splits it)."""
    for item in filter(None, text.split(",")):
        positive(item)
    return text


def resolve_defaults(args: argparse.Namespace) -> argparse.Namespace:
    for key, value in PRESETS["quick" if args.quick else "full"].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


@dataclass
class Models:
    """What is benchmarked: folders, and the heads by method."""

    label: str  # "demo tiny", "demo small" or the target folder's name
    target_dir: Path
    tokenizer_dir: Path
    draft_dir: Path | None
    heads: dict[str, Path] = field(default_factory=dict)
    skipped: list[dict] = field(default_factory=list)  # {"method", "reason"}
    serve_model: dict = field(default_factory=dict)  # the OutriderArgs keys naming the model
    serve_name: str = ""


def resolve_models(args: argparse.Namespace, methods: list[str], log=print) -> Models:
    explicit = dict(item.split("=", 1) for item in args.head)
    if args.model:
        target = Path(args.model)
        models = Models(
            target.name, target, Path(args.tokenizer or args.model), args.draft and Path(args.draft)
        )
        models.serve_model = {"model": str(target), "tokenizer": str(models.tokenizer_dir)}
        models.serve_name = target.resolve().name
    else:
        from outrider.demo.family import ensure_demo_family
        from outrider.draft_worker.training.demo_heads import demo_head_dir, head_dir, verify_head

        family = ensure_demo_family(args.size, progress=False, log=log)
        models = Models(
            f"demo {args.size} ({family.root.name})",
            family.target_dir,
            family.tokenizer_dir,
            family.draft_dir,
        )
        models.serve_model, models.serve_name = {"demo": args.size}, f"outrider-demo-{args.size}"
    from outrider.draft_worker.training.demo_heads import head_methods

    trained = set(head_methods())  # methods whose drafter is a trained head
    for method in methods:
        if method in ("ngram", "suffix"):
            continue
        if method == "draft_model":
            if models.draft_dir is None:
                models.skipped.append({"method": method, "reason": "no draft LM (pass --draft DIR)"})
            continue
        if method in explicit:
            models.heads[method] = Path(explicit[method])
        elif method not in trained:
            continue  # no trainer: `method_table` tries it at a generic shape; a failed build is skipped
        elif args.model:
            models.skipped.append({"method": method, "reason": "no head given (--head METHOD=DIR)"})
        elif args.no_build_heads:
            try:
                verify_head(head_dir(family, method))
                models.heads[method] = head_dir(family, method)
            except Exception as e:  # not built, or corrupt
                models.skipped.append(
                    {"method": method, "reason": f"demo head not built (--no-build-heads): {e}"}
                )
        else:
            started = time.perf_counter()
            models.heads[method] = demo_head_dir(family, method, progress=False, log=log)
            log(f"{method} head ready in {time.perf_counter() - started:.0f} s: {models.heads[method]}")
    return models


def method_table(models: Models, methods: list[str]) -> dict[str, dict | None]:
    """Label -> speculative config (None = plain) for every method that has what it needs."""
    from outrider.benchmarks.bench_drafting import method_configs
    from outrider.benchmarks.bench_medusa import medusa_configs

    heads = {m: str(f) for m, f in models.heads.items()}
    table = method_configs(str(models.draft_dir), heads)
    if models.draft_dir is None:
        table = {k: v for k, v in table.items() if not (v and v["method"] == "draft_model")}
    if "medusa" in heads:
        table |= {k: v for k, v in medusa_configs(heads["medusa"]).items() if v}
    if "mtp" in heads:
        mtp = {"method": "mtp", "model": heads["mtp"]}
        table |= {
            "mtp-1": {**mtp, "num_speculative_tokens": 1},
            "mtp-chain": {**mtp, "num_speculative_tokens": 3},
        }
    # plain first, then the registry's order (model-free methods, draft LM, heads), chain before tree
    rank = {m: i for i, m in enumerate(dict.fromkeys(["ngram", "suffix", "draft_model", *methods]))}
    table = dict(
        sorted(table.items(), key=lambda kv: -1 if kv[1] is None else rank.get(kv[1]["method"], len(rank)))
    )
    covered = {c["method"] for c in table.values() if c} | {s["method"] for s in models.skipped}
    for method in methods:  # a method registered later still runs, at a generic chain shape
        if method not in covered:
            table[method] = {
                "method": method,
                "num_speculative_tokens": 4,
                **({"model": heads[method]} if method in heads else {}),
            }
    return table


def cli_main(args: argparse.Namespace) -> int:
    """The `outrider bench` subcommand (and `python -m outrider.benchmarks.bench`)."""
    if args.schema:
        from outrider.benchmarks.bench_schema import SCHEMA

        print(json.dumps(SCHEMA, indent=2))
        return 0
    from outrider.benchmarks.bench_sweep import run_bench

    def log(message: str) -> None:
        print(f"{time.strftime('%H:%M:%S')} {message}", flush=True)

    resolve_defaults(args)
    json_path = Path(args.json) if args.json else RESULTS_DIR / f"bench_{args.size}.json"
    report = run_bench(args, log=log)
    from outrider.benchmarks.bench_render import write_outputs

    for path in write_outputs(report, json_path):
        log(f"wrote {path}")
    for line in report["headline"]:
        print(
            f"headline T={line['temperature']:g} {line['prompt_set']}: {line['best_method']} "
            f"{line['speedup_vs_plain']:.2f}x plain, {_fmt(line['speedup_vs_hf_assisted'])}x transformers assisted"
        )
    return 0


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m outrider.benchmarks.bench", description=__doc__.splitlines()[0]
    )
    add_bench_arguments(parser)
    return cli_main(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
