"""Medusa heads through the step engine, next to plain decoding, on a demo family.

    python -m outrider.benchmarks.bench_medusa --size small                 # the issue's setting
    python -m outrider.benchmarks.bench_medusa --size tiny --prompts 2 --repeats 1

The sweep, its figures (tau, tokens/s and speedups against plain in the same run, per-position
acceptance, drafter ms per round, looping share, tau on non-looping outputs) and the report
format are bench_drafting's: this script trains (or loads) the family's Medusa heads through
`draft_worker.training.demo_heads` and runs bench_drafting's `main` with a method table of Medusa shapes
instead of its own. Every other option is bench_drafting's and is passed through.
"""

from __future__ import annotations

import argparse

from outrider.benchmarks import bench_drafting


def medusa_configs(heads_dir: str) -> dict[str, dict | None]:
    """Method label -> speculative config; None = plain decoding.

    Heads run in bf16 (`dtype`): at batch 1 the heads' V x H matmul is bound by reading its
    weights, and halving them is worth ~2 ms a round on the small family; `-fp32` keeps the
    checkpoint's dtype for comparison.
    """
    medusa = {"method": "medusa", "model": heads_dir, "dtype": "bfloat16"}
    tree_8 = {"num_speculative_tokens": 3, "tree_top_k": 3, "tree_max_nodes": 8}
    tree_16 = {"num_speculative_tokens": 4, "tree_top_k": 4, "tree_max_nodes": 16}
    return {
        "plain": None,
        "medusa-chain": {**medusa, "num_speculative_tokens": 3},
        "medusa-tree-8": {**medusa, **tree_8},
        "medusa-tree-16": {**medusa, **tree_16},
        "medusa-tree-16-fp32": {**medusa, **tree_16, "dtype": "float32"},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], add_help=False)
    parser.add_argument("--size", default="small")
    parser.add_argument("--name", default=None)
    parser.add_argument("--heads", default=None, help="a Medusa heads folder (default: the demo family's)")
    args, rest = parser.parse_known_args(argv)

    from outrider.demo.family import ensure_demo_family
    from outrider.draft_worker.training.demo_heads import demo_head_dir

    heads = args.heads or str(demo_head_dir(ensure_demo_family(args.size), "medusa"))
    # bench_drafting builds its engines from `method_configs(...)`: here, Medusa shapes only.
    bench_drafting.method_configs = lambda *_args, **_kwargs: medusa_configs(heads)
    name = args.name or f"bench_medusa_{args.size}"
    return bench_drafting.main(["--size", args.size, "--name", name, *rest])


if __name__ == "__main__":
    raise SystemExit(main())
