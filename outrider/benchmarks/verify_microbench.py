"""Verification microbenchmark: batch x tree size x vocabulary, torch reference vs Triton.

    python -m outrider.benchmarks.verify_microbench            # small CPU grid, a couple of minutes
    python -m outrider.benchmarks.verify_microbench --full     # bigger grid (meant for a GPU)

Times `kernels.verify` (the tree walk only: target probs and random numbers are inputs) for
greedy and sampled (WITH_REPLACEMENT) batches of random trees whose tokens follow the
target's argmax half the time, so walks go a few levels deep. Triton runs where a CUDA
device is. Writes benchmarks/results/verify_microbench.{json,md}.
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import statistics
import time

import torch

from outrider.benchmarks.report import RESULTS_DIR
from outrider.kernels.packing import PackedTrees
from outrider.kernels.verification import draw_verify_randoms, verify


def random_batch(batch: int, nodes: int, vocab: int, q_top_k: int, device: str, gen: torch.Generator):
    """Trees of `nodes` nodes (random parents), target probs [batch * nodes, vocab], sparse q."""
    parents = torch.cat([torch.tensor([-1]), torch.randint(0, 1 << 30, (nodes - 1,), generator=gen)])
    parents[1:] %= torch.arange(1, nodes)
    logits = torch.randn(batch * nodes, vocab, generator=gen) * 4
    probs = logits.softmax(-1)
    tokens = torch.randint(0, vocab, (batch * nodes,), generator=gen)
    flat_parents = (torch.arange(batch)[:, None] * nodes + parents.clamp(min=0)).reshape(-1)
    follow = torch.rand(batch * nodes, generator=gen) < 0.5
    tokens = torch.where(follow, probs[flat_parents].argmax(-1), tokens)
    q_ids = torch.randint(0, vocab, (batch * nodes, q_top_k), generator=gen)
    q_ids[:, 0] = probs.argmax(-1)
    trees = PackedTrees(
        token_ids=tokens,
        parents=parents.repeat(batch),
        cu_num_draft_tokens=torch.arange(batch + 1) * nodes,
        sampling=torch.ones(batch, dtype=torch.int64),
        q_index=torch.arange(batch * nodes),
        q_token_ids=q_ids,
        q_probs=torch.rand(batch * nodes, q_top_k, generator=gen),
        max_num_nodes=nodes,
    )
    return trees.to(device), probs.to(device)


def time_ms(fn, repeats: int, device: str) -> float:
    fn()  # warm-up (and Triton compilation)
    samples = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help="bigger grid (GPU)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.full:
        batches, sizes, vocabs = [1, 8, 32, 64], [8, 32, 64], [32_000, 128_256]
    else:
        batches, sizes, vocabs = [2, 16], [8, 32], [1_024, 32_000]
    backends = ["torch", "triton"] if device == "cuda" else ["torch"]
    gen = torch.Generator().manual_seed(0)
    rows = []
    for batch, nodes, vocab in itertools.product(batches, sizes, vocabs):
        trees, probs = random_batch(batch, nodes, vocab, 8, device, gen)
        randoms = draw_verify_randoms(trees.cu_num_draft_tokens, vocab, gen.manual_seed(1), device="cpu")
        randoms.uniforms, randoms.exponentials = randoms.uniforms.to(device), randoms.exponentials.to(device)
        for mode, backend in itertools.product(["greedy", "sampled"], backends):
            is_greedy = torch.full((batch,), mode == "greedy", device=device)
            run = lambda: verify(trees, probs, is_greedy, randoms, backend=backend)  # noqa: B023
            ms = time_ms(run, args.repeats, device)
            tau = float(run().num_output_tokens.float().mean())
            rows.append(
                dict(batch=batch, nodes=nodes, vocab=vocab, mode=mode, backend=backend, ms=ms, tau=tau)
            )
            print(
                f"batch {batch:3d} nodes {nodes:3d} vocab {vocab:6d} {mode:7s} {backend:6s}"
                f" {ms:8.2f} ms  tau {tau:.2f}"
            )
    write_report(rows, device, args)


def write_report(rows: list[dict], device: str, args: argparse.Namespace) -> None:
    RESULTS_DIR.mkdir(exist_ok=True)
    env = dict(
        device=torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu",
        torch=torch.__version__,
        threads=args.threads,
        repeats=args.repeats,
    )
    name = "verify_microbench_cuda" if device == "cuda" else "verify_microbench"
    (RESULTS_DIR / f"{name}.json").write_text(json.dumps(dict(env=env, rows=rows), indent=1) + "\n")
    lines = [
        "# Verification microbenchmark",
        "",
        f"`python -m outrider.benchmarks.verify_microbench{' --full' if args.full else ''}` on {env['device']}"
        f" (torch {env['torch']}, {args.threads} CPU thread(s), median of {args.repeats}).",
        "Time of one `kernels.verify` call over the batch; tau = mean output tokens per tree.",
        "",
        "| batch | nodes | vocab | mode | backend | ms | tau |",
        "| ---: | ---: | ---: | --- | --- | ---: | ---: |",
    ]
    lines += [
        "| "
        + " | ".join(str(r[k]) for k in ("batch", "nodes", "vocab", "mode", "backend"))
        + f" | {r['ms']:.2f} | {r['tau']:.2f} |"
        for r in rows
    ]
    (RESULTS_DIR / f"{name}.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
