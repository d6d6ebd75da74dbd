"""The paged KV cache against the extent-based engine it replaced, measured in one run.

    python -m outrider.benchmarks.bench_paging --size small        # the committed report
    python -m outrider.benchmarks.bench_paging --size tiny --baseline-commit none   # paged only

Three workloads, each run by this checkout's engine ("paged") and by the engine of
`--baseline-commit` (default: the last commit with per-sequence extents), each in its own
process (the baseline's source is exported from git into a temporary `outrider` namespace):

- **concurrency**: a KV budget of `--kv-slots` (2,048) slots and 32 requests of 32 prompt
  tokens with max_tokens 224 whose outputs end after about 32 tokens at a stop string (the
  text the target's greedy output reaches at token 32, found first with a roomy cache). Extents
  reserve prompt + max_tokens per request at admission; blocks are taken as tokens come.
  Reported: the most and the mean sequences per step, preemptions, output token throughput,
  mean TTFT.
- **prefix**: 16 requests sharing a 192-token prefix (16 tokens of their own, 16 out), sent
  together after one earlier request with the same prefix (a warm system prompt). Reported:
  prompt tokens prefilled and mean TTFT, with prefix caching off and on.
- **throughput**: plain decoding at batch 1, 16 and 64 and draft_model speculation (fixed K = 4)
  at batch 16, 32-token prompts, 64 tokens out, a cache with room for every sequence.

Each engine runs the workloads `--repeats` times (3) in alternating order; every figure is
the median over its runs. Ratios are within this run; on this 2-core machine absolute tokens/s
drift 15-25% over minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BASELINE_COMMIT = "db84719"  # the last engine with per-sequence KV extents
PACKAGES = ("proto", "kernels", "target_worker", "draft_worker", "demo", "cluster", "benchmarks")
OWN_TOKENS, STOP_AFTER = 16, 32


# ---- the driver ----------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    from outrider.benchmarks.report import add_run_arguments, write_run_report
    from outrider.demo.family import ensure_demo_family

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_run_arguments(parser, max_tokens=224, prompt_tokens=32)
    parser.add_argument("--kv-slots", type=int, default=2048, help="KV budget of the concurrency workload")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prefix-tokens", type=int, default=192, help="shared prefix of the prefix workload")
    parser.add_argument("--baseline-commit", default=BASELINE_COMMIT, help="'none': paged only")
    parser.add_argument("--repeats", type=int, default=3, help="runs per engine, alternating; medians")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per engine (default: 1)")
    parser.add_argument("--worker", nargs=2, metavar=("IN", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return run_worker(Path(args.worker[0]), Path(args.worker[1]))
    family = ensure_demo_family(args.size)
    spec = {**workload_spec(family, args), "threads": args.threads}
    engines = {"paged": None}
    if args.baseline_commit != "none":
        engines = {"extents": args.baseline_commit, **engines}
    runs: dict[str, list[dict]] = {kind: [] for kind in engines}
    for repeat in range(args.repeats):  # alternating order: drift on a shared machine hits both
        order = list(engines.items()) if repeat % 2 == 0 else list(engines.items())[::-1]
        for kind, commit in order:
            runs[kind].append(run_in_process(spec, kind, commit))
    rows = report_rows({kind: medians(measured) for kind, measured in runs.items()})
    notes = (__doc__.split("\n\n", 2)[2] if __doc__ else "") + (
        f"\nFamily `{args.size}` (max_model_len {spec['max_model_len']}); baseline commit "
        f"`{args.baseline_commit}`; {args.threads} torch thread(s) per engine. Speedups: paged / "
        "extents in this run."
    )
    write_run_report("paging", rows, args, title="Paged KV cache vs per-sequence extents", notes=notes)


def workload_spec(family, args) -> dict:
    """Prompts and stop strings, fixed here so both engines get the same work."""
    import torch

    config = json.loads((Path(family.target_dir) / "config.json").read_text())
    vocab = config["vocab_size"]
    gen = torch.Generator().manual_seed(0)

    def prompts(count: int, length: int) -> list[list[int]]:
        return [torch.randint(0, vocab, (length,), generator=gen).tolist() for _ in range(count)]

    concurrency = prompts(args.requests, args.prompt_tokens)
    prefix = prompts(1, args.prefix_tokens)[0]
    spec = {
        "target_dir": str(family.target_dir),
        "tokenizer_dir": str(family.tokenizer_dir),
        "draft_dir": str(family.draft_dir),
        "max_model_len": config["max_position_embeddings"],
        "kv_slots": args.kv_slots,
        "max_tokens": args.max_tokens,
        "concurrency_prompts": concurrency,
        "prefix_prompts": [prefix + p for p in prompts(17, OWN_TOKENS)],
        "throughput_prompts": prompts(64, args.prompt_tokens),
    }
    spec["stops"] = stop_strings(spec, concurrency)
    return spec


def stop_strings(spec: dict, prompts: list[list[int]]) -> list[str]:
    """Per prompt: the last characters of its greedy output's first STOP_AFTER tokens (the
    shortest tail not met earlier, so it stops there)."""
    from outrider.target_worker.engine import Engine
    from outrider.target_worker.runner import ModelRunner
    from outrider.target_worker.sequence import RequestParams

    runner = ModelRunner.from_pretrained(spec["target_dir"], max_model_len=spec["max_model_len"])
    detokenize = _detokenizer(spec["tokenizer_dir"])
    engine = Engine(runner, eos_token_id=None, max_batch=16, detokenize=detokenize)

    stops = []
    for completion in engine.generate(prompts, RequestParams(max_tokens=STOP_AFTER)):
        text = detokenize(completion.token_ids)
        tail = next(n for n in range(4, len(text) + 1) if text[-n:] not in text[:-1] and text[-n:].strip())
        stops.append(text[-tail:])
    return stops


def run_in_process(spec: dict, kind: str, commit: str | None) -> dict:
    """Runs the workloads in a fresh process: this checkout's engine, or `commit`'s."""
    env = {**os.environ, "OMP_NUM_THREADS": str(spec.get("threads", 1))}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if commit is not None:
            env["PYTHONPATH"] = str(export_commit(commit, tmp))
        (tmp / "in.json").write_text(json.dumps({**spec, "kind": kind}))
        worker = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--worker",
            str(tmp / "in.json"),
            str(tmp / "out.json"),
        ]
        print(f"[{kind}] running the workloads ...", flush=True)
        subprocess.run(worker, env=env, check=True)
        return json.loads((tmp / "out.json").read_text())


def export_commit(commit: str, into: Path) -> Path:
    """`commit`'s sources as an importable `outrider` namespace under `into`; returns the path to import from."""
    repo = Path(__file__).resolve().parents[2]
    source = into / "src"
    source.mkdir()
    archive = subprocess.run(
        ["git", "-C", str(repo), "archive", commit], check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(source)], input=archive, check=True)
    namespace = into / "path" / "outrider"
    namespace.mkdir(parents=True)
    for package in PACKAGES:
        (namespace / package).symlink_to(source / package)
    return into / "path"


def medians(runs: list[dict]) -> dict:
    """Per workload and case, the median of each figure over the runs."""
    import statistics

    return {
        workload: {
            case: {key: statistics.median(run[workload][case][key] for run in runs) for key in figures}
            for case, figures in cases.items()
        }
        for workload, cases in runs[0].items()
    }


def report_rows(results: dict) -> list[dict]:
    rows = []
    base = results.get("extents", {})
    for workload in ("concurrency", "prefix", "throughput"):
        for kind, measured in results.items():
            for case, figures in measured[workload].items():
                row = {"workload": workload, "engine": kind, "case": case, **figures}
                reference = base.get(workload, {}).get(case.replace(" +prefix cache", ""))
                if kind != "extents" and reference and reference.get("output_tok_s"):
                    row["speedup_vs_extents"] = figures["output_tok_s"] / reference["output_tok_s"]
                rows.append(row)
    return rows


# ---- the worker (runs under either engine: only API both have) -------------------------------


def run_worker(in_path: Path, out_path: Path) -> None:
    import torch

    spec = json.loads(in_path.read_text())
    torch.set_num_threads(spec.get("threads", 1))
    out = {
        "concurrency": concurrency_workload(spec),
        "prefix": prefix_workload(spec),
        "throughput": throughput_workload(spec),
    }
    out_path.write_text(json.dumps(out))


def _engine(
    spec: dict, kv_slots: int, *, max_batch: int, source=None, prefix_caching: bool | None = None, **kw
):
    from outrider.target_worker.engine import Engine
    from outrider.target_worker.runner import ModelRunner

    runner = ModelRunner.from_pretrained(
        spec["target_dir"], max_model_len=spec["max_model_len"], kv_cache_rows=kv_slots
    )
    options = {} if spec["kind"] == "extents" else {"prefix_caching": bool(prefix_caching)}
    return Engine(runner, source, eos_token_id=None, max_batch=max_batch, **options, **kw)


def _serve(engine, prompts: list[list[int]], params: list) -> dict:
    """Runs the requests to the end; throughput, TTFT and batch occupancy."""
    prefilled = engine.stats.num_prefill_tokens
    start = time.perf_counter()
    ids = [engine.add_request(p, q) for p, q in zip(prompts, params, strict=True)]
    first: dict[int, float] = {}
    outputs, steps, running_sum, most = 0, 0, 0, 0
    while engine.has_unfinished():
        for out in engine.step():
            outputs += len(out.new_token_ids)
            if out.new_token_ids and out.request_id not in first:
                first[out.request_id] = time.perf_counter() - start
        steps += 1
        running_sum += len(engine.running)
        most = max(most, len(engine.running))
    wall = time.perf_counter() - start
    return {
        "requests": len(ids),
        "output_tokens": outputs,
        "output_tok_s": outputs / wall,
        "mean_ttft_ms": 1000 * sum(first.values()) / max(len(first), 1),
        "most_running": most,
        "mean_running": running_sum / max(steps, 1),
        "prefill_tokens": engine.stats.num_prefill_tokens - prefilled,
        "preemptions": getattr(engine.stats, "num_preemptions", 0),
        "wall_s": wall,
    }


def concurrency_workload(spec: dict) -> dict:
    from outrider.target_worker.sequence import RequestParams

    detokenize = _detokenizer(spec["tokenizer_dir"])
    engine = _engine(
        spec, spec["kv_slots"], max_batch=len(spec["concurrency_prompts"]), detokenize=detokenize
    )
    params = [RequestParams(max_tokens=spec["max_tokens"], stop=(stop,)) for stop in spec["stops"]]
    return {
        f"{spec['kv_slots']} KV slots, stop at ~{STOP_AFTER} tokens": _serve(
            engine, spec["concurrency_prompts"], params
        )
    }


def prefix_workload(spec: dict) -> dict:
    from outrider.target_worker.sequence import RequestParams

    warm, rest = spec["prefix_prompts"][0], spec["prefix_prompts"][1:]
    params = RequestParams(max_tokens=OWN_TOKENS)
    cases = {}
    for caching in (False, True) if spec["kind"] != "extents" else (False,):
        engine = _engine(spec, 32 * spec["max_model_len"], max_batch=len(rest), prefix_caching=caching)
        _serve(engine, [warm], [params])
        name = f"{len(rest)} requests, {len(warm) - OWN_TOKENS}-token shared prefix"
        cases[name + (" +prefix cache" if caching else "")] = _serve(engine, rest, [params] * len(rest))
    return cases


def throughput_workload(spec: dict) -> dict:
    from outrider.draft_worker import build_proposer
    from outrider.proto import TreeBudget
    from outrider.target_worker.draft_source import InProcessDraftSource
    from outrider.target_worker.sequence import RequestParams

    params = RequestParams(max_tokens=64)
    cases = {}
    for name, batch, speculate in (
        ("plain b1", 1, False),
        ("plain b16", 16, False),
        ("plain b64", 64, False),
        ("draft_model K=4 b16", 16, True),
    ):
        source, budget = None, {}
        if speculate:
            config = {"method": "draft_model", "model": spec["draft_dir"], "num_speculative_tokens": 4}
            import outrider.draft_worker.draft_model  # noqa: F401 - registers draft_model

            vocab = json.loads((Path(spec["target_dir"]) / "config.json").read_text())["vocab_size"]
            proposer = build_proposer(config, vocab_size=vocab)
            source = InProcessDraftSource(proposer)
            budget = {"tree_budget": TreeBudget(max_nodes=5, max_depth=4, top_k=1), "budget_policy": "fixed"}
        engine = _engine(spec, batch * spec["max_model_len"], max_batch=batch, source=source, **budget)
        prompts = spec["throughput_prompts"][:batch]
        _serve(engine, spec["throughput_prompts"][:2], [params] * 2)  # warm-up
        cases[name] = _serve(engine, prompts, [params] * batch)
    return cases


def _detokenizer(tokenizer_dir: str):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


if __name__ == "__main__":
    main()
