"""Target-worker benchmark on the demo target: plain decode, verify-forward cost, runner vs HF.

    python -m outrider.benchmarks.bench_target                 # the small demo family (built if absent)
    python -m outrider.benchmarks.bench_target --size tiny     # seconds; for a quick look

Three measurements, each repeated with its variants interleaved inside every repeat (other
processes share these machines: absolute speeds drift 15-25% over minutes, ratios within one
repeat hold), reported as medians over repeats:

1. `plain`: tokens/s of the Engine with speculation off (the baseline every later method's
   `speedup_vs_plain` divides by), greedy, at batch 1, 4 and 16, on held-out mid-file
   prompts; end to end (prefill included) and over decode-only rounds.
2. `verify_forward`: one runner forward of an n-node tree (n = 1, 4, ..., 64) per sequence
   after a prompt-length context, relative to a 1-token decode of the same batch: the curve
   that decides how big a tree pays on this hardware.
3. `runner_step` / `transformers_step`: 1-token decode latency of this runner and of
   `transformers`' own forward with its KV cache, side by side.

Writes benchmarks/results/bench_target_<size>.{json,md}. Every row carries the harness's
DecodeRow fields (null where they do not apply) plus its own.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from outrider.benchmarks.prompts import load_prompts
from outrider.benchmarks.report import DecodeRow, markdown_table, write_report
from outrider.target_worker.batch import SequenceChunk, build_forward_batch
from outrider.target_worker.engine import Engine
from outrider.target_worker.runner import ModelRunner
from outrider.target_worker.sequence import RequestParams

BATCH_SIZES = (1, 4, 16)
TREE_SIZES = (1, 4, 8, 16, 32, 64)
VERIFY_BATCHES = (1, 4)
PROMPT_SET = "mid"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m outrider.benchmarks.bench_target", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--size", choices=("tiny", "small"), default="small", help="demo family size")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved repeats; medians are reported")
    parser.add_argument("--new-tokens", type=int, default=64, help="output tokens per request (plain decode)")
    parser.add_argument("--prompt-tokens", type=int, default=None, help="default: half the target's context")
    parser.add_argument("--steps", type=int, default=16, help="timed calls per variant per repeat (forwards)")
    parser.add_argument("--device", default="cpu")
    return parser.parse_args()


def median(values: list[float]) -> float:
    return statistics.median(values)


def plain_decode(runner: ModelRunner, prompts: list[list[int]], new_tokens: int) -> dict:
    """One engine run, speculation off: end-to-end and decode-only tokens/s."""
    engine = Engine(runner, eos_token_id=None, max_batch=len(prompts), max_prefill_tokens=2048)
    for prompt in prompts:
        engine.add_request(prompt, RequestParams(max_tokens=new_tokens, ignore_eos=True))
    total = decode_time = 0.0
    decode_tokens = 0
    while engine.has_unfinished():
        prefill_before = engine.stats.num_prefill_tokens
        t0 = time.perf_counter()
        outputs = engine.step()
        dt = time.perf_counter() - t0
        total += dt
        if engine.stats.num_prefill_tokens == prefill_before:
            decode_time += dt
            decode_tokens += sum(len(o.new_token_ids) for o in outputs)
    return {
        "tokens_per_s": engine.stats.num_output_tokens / total,
        "decode_tokens_per_s": decode_tokens / decode_time,
        "ms_per_round": 1e3 * total / engine.stats.num_rounds,
    }


def bench_plain(runner: ModelRunner, prompts: list[list[int]], args) -> list[dict]:
    runs: dict[int, list[dict]] = {b: [] for b in BATCH_SIZES}
    plain_decode(runner, prompts[:1], 8)  # warm-up
    for _ in range(args.repeats):
        for batch in BATCH_SIZES:
            runs[batch].append(plain_decode(runner, prompts[:batch], args.new_tokens))
    rows = []
    for batch, results in runs.items():
        row = DecodeRow(
            method="plain",
            prompt_set=PROMPT_SET,
            temperature=0.0,
            tokens_per_s=median([r["tokens_per_s"] for r in results]),
            speedup_vs_plain=1.0,
            acceptance_length=None,
            extra={
                "section": "plain_decode",
                "batch_size": batch,
                "decode_tokens_per_s": median([r["decode_tokens_per_s"] for r in results]),
                "ms_per_round": median([r["ms_per_round"] for r in results]),
            },
        )
        rows.append(row.to_dict())
    return rows


def random_tree(nodes: int, vocab: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Tokens and parents of an n-node tree (each node under a random earlier one); n = 1: a decode."""
    tokens = torch.randint(0, vocab, (nodes,), generator=gen)
    if nodes == 1:
        return tokens, None
    parents = torch.cat(
        [torch.tensor([-1]), (torch.rand(nodes - 1, generator=gen) * torch.arange(1, nodes)).long()]
    )
    return tokens, parents


def time_forward(runner: ModelRunner, batch, steps: int) -> float:
    """Median ms of `steps` forwards of one prebuilt batch."""
    samples = []
    for _ in range(steps):
        t0 = time.perf_counter()
        runner.forward(batch)
        samples.append(time.perf_counter() - t0)
    return 1e3 * median(samples)


def bench_verify(runner: ModelRunner, prompts: list[list[int]], args) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    vocab = runner.model.vocab_size
    starts = []  # (extent start, context length) of each sequence; trees only write past the context
    for b, prompt in enumerate(prompts[: max(VERIFY_BATCHES)]):
        start = runner.cache.allocate(10_000 + b, len(prompt) + max(TREE_SIZES))
        runner.forward(
            build_forward_batch([SequenceChunk(start, 0, torch.tensor(prompt))], device=runner.device)
        )
        starts.append((start, len(prompt)))
    batches = {}
    for batch_size in VERIFY_BATCHES:
        for nodes in TREE_SIZES:
            chunks = [SequenceChunk(s, n, *random_tree(nodes, vocab, gen)) for s, n in starts[:batch_size]]
            batches[batch_size, nodes] = build_forward_batch(chunks, device=runner.device)
    ms: dict[tuple[int, int], list[float]] = {key: [] for key in batches}
    relative: dict[tuple[int, int], list[float]] = {key: [] for key in batches}
    for batch in batches.values():  # warm-up
        time_forward(runner, batch, 2)
    for _ in range(args.repeats):
        this_repeat = {key: time_forward(runner, batch, args.steps) for key, batch in batches.items()}
        for (batch_size, nodes), value in this_repeat.items():
            ms[batch_size, nodes].append(value)
            relative[batch_size, nodes].append(value / this_repeat[batch_size, 1])
    for b in range(len(starts)):
        runner.cache.free(10_000 + b)
    rows = []
    for (batch_size, nodes), values in ms.items():
        row = DecodeRow(
            method="verify_forward",
            prompt_set=PROMPT_SET,
            temperature=None,
            tokens_per_s=1e3 * batch_size * nodes / median(values),  # tree nodes verified per second
            speedup_vs_plain=None,
            acceptance_length=None,
            extra={
                "section": "verify_cost",
                "batch_size": batch_size,
                "tree_nodes": nodes,
                "ms": median(values),
                "relative_to_decode": median(relative[batch_size, nodes]),
            },
        )
        rows.append(row.to_dict())
    return rows


def bench_vs_transformers(target_dir: Path, runner: ModelRunner, prompt: list[int], args) -> list[dict]:
    """1-token decode latency after a prompt: this runner vs transformers with its KV cache."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    ids = torch.tensor(prompt)
    start = runner.cache.allocate(20_000, len(prompt) + args.steps + 1)

    def ours(steps: int) -> float:
        out = runner.forward(build_forward_batch([SequenceChunk(start, 0, ids)], device=runner.device))
        token = out.logits[-1].argmax()
        t0 = time.perf_counter()
        for i in range(steps):
            chunk = SequenceChunk(start, len(prompt) + i, token.view(1))
            token = runner.forward(build_forward_batch([chunk], device=runner.device)).logits[-1].argmax()
        return 1e3 * (time.perf_counter() - t0) / steps

    @torch.inference_mode()
    def theirs(steps: int) -> float:
        cache = transformers.DynamicCache(config=model.config)
        token = model(input_ids=ids[None], cache=cache, use_cache=True).logits[0, -1].argmax()
        t0 = time.perf_counter()
        for _ in range(steps):
            token = model(input_ids=token.view(1, 1), cache=cache, use_cache=True).logits[0, -1].argmax()
        return 1e3 * (time.perf_counter() - t0) / steps

    ours(4), theirs(4)
    ms_ours, ms_theirs, ratios = [], [], []
    for _ in range(4 * args.repeats):  # cheap: more, shorter rounds follow the drift better
        a, b = ours(args.steps), theirs(args.steps)
        ms_ours.append(a)
        ms_theirs.append(b)
        ratios.append(b / a)
    runner.cache.free(20_000)
    speedup = median(ratios)
    rows = []
    for method, values, relative in (
        ("runner_step", ms_ours, 1.0),
        ("transformers_step", ms_theirs, 1 / speedup),
    ):
        row = DecodeRow(
            method=method,
            prompt_set=PROMPT_SET,
            temperature=0.0,
            tokens_per_s=1e3 / median(values),
            speedup_vs_plain=relative,  # relative to this runner's own 1-token step
            acceptance_length=None,
            extra={
                "section": "runner_vs_transformers",
                "batch_size": 1,
                "ms": median(values),
                "best_ms": min(values),
            },
        )
        rows.append(row.to_dict())
    return rows


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    from outrider.demo.family import ensure_demo_family

    family = ensure_demo_family(args.size)
    tokenizer = AutoTokenizer.from_pretrained(family.tokenizer_dir)
    context = family.manifest["target"]["context"]
    prompt_tokens = args.prompt_tokens or context // 2
    prompts = [
        p.token_ids
        for p in load_prompts(PROMPT_SET, tokenizer, count=max(BATCH_SIZES), prompt_tokens=prompt_tokens)
    ]
    runner = ModelRunner.from_pretrained(
        family.target_dir, max_model_len=context, kv_cache_rows=32 * context, device=args.device
    )
    started = time.time()
    plain = bench_plain(runner, prompts, args)
    verify_rows = bench_verify(runner, prompts, args)
    versus = bench_vs_transformers(family.target_dir, runner, prompts[0], args)
    meta = {
        "size": args.size,
        "family": family.root.name,
        "target_parameters": family.manifest["target"]["parameters"],
        "prompt_set": PROMPT_SET,
        "prompt_tokens": prompt_tokens,
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "steps": args.steps,
        "threads": args.threads,
        "device": args.device,
        "seconds": round(time.time() - started, 1),
    }
    speedup = 1 / versus[1]["speedup_vs_plain"]
    verify_table = markdown_table(verify_rows, ["batch_size", "tree_nodes", "ms", "relative_to_decode"])
    notes = f"""
`python -m outrider.benchmarks.bench_target --size {args.size}`: demo target `{family.root.name}`,
{args.threads} torch thread(s), held-out `{PROMPT_SET}` prompts of {prompt_tokens} tokens. The machine
is shared with other work, so every figure is a median over {args.repeats} repeats with the
variants interleaved inside each repeat; ratios are steadier than absolute speeds.

**Plain decode**: Engine with speculation off, greedy, {args.new_tokens} new tokens per request;
`tokens_per_s` end to end (prefill included), `decode_tokens_per_s` over decode-only rounds.
**Verify-forward cost**: one runner forward with an n-node tree per sequence after a
{prompt_tokens}-token context, relative to a 1-token decode of the same batch (for these rows
`tokens_per_s` counts tree nodes):

{verify_table}
**Runner vs transformers**, 1-token decode after a {prompt_tokens}-token prompt, batch 1: this
runner is **{speedup:.2f}x** faster (median of per-round ratios, interleaved rounds).
"""
    json_path, md_path = write_report(
        f"bench_target_{args.size}",
        plain + verify_rows + versus,
        meta,
        title=f"Target worker on the {args.size} demo target",
        notes=notes,
        columns=[
            "section",
            "method",
            "batch_size",
            "tree_nodes",
            "tokens_per_s",
            "decode_tokens_per_s",
            "ms_per_round",
            "ms",
            "relative_to_decode",
            "speedup_vs_plain",
        ],  # fmt: skip
    )
    print(md_path.read_text())
    print(f"wrote {json_path} and {md_path}")


if __name__ == "__main__":
    main()
