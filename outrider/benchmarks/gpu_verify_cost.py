"""Verify cost on a GPU: an n-node tree forward vs a 1-token decode, for a Llama-3.1-8B-shaped slice.

    python -m outrider.benchmarks.gpu_verify_cost                  # 4 layers of the 8B shape, bf16, on cuda
    python -m outrider.benchmarks.gpu_verify_cost --layers 32      # the whole depth (16 GB of weights)

Why: speculation pays when verifying a tree costs little more than decoding one token. On
the 2-core CPU a 16-node tree costs ~2x a decode (docs/algorithms.md section 9), so CPU trees must stay
small; on a GPU the forward is memory-bound at small batch and the curve is much flatter,
until the batch is large enough to make the forward compute-bound — the batch sizes where
co-located speculation stops paying. This measures that curve for Outrider's own runner.

The checkpoint is random (bf16 weights written straight to safetensors, the Hugging Face
Llama key layout) with the real 8B dimensions (H 4096, 32 heads, 8 KV heads, intermediate
14336, vocabulary 128256) and fewer layers; per-layer costs scale with depth, the LM head
does not. Each sequence has a `--context`-token prompt cached first; every timed forward is
synchronised. The cache is paged as the engine pages it (block tables from `BlockManager`,
16-slot blocks), so attention runs the paged Triton kernel. A decode row also reports its
share of the memory-bandwidth bound: (weights + the K/V it reads) / `--bandwidth-tbs`
(default 4.8 TB/s, the H200's datasheet figure) over the measured time.
Writes benchmarks/results/gpu_verify_cost.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from outrider.benchmarks.bench_target import random_tree
from outrider.benchmarks.report import DecodeRow, write_report
from outrider.target_worker.batch import SequenceChunk, build_forward_batch
from outrider.target_worker.block_manager import BlockManager
from outrider.target_worker.runner import ModelRunner

BLOCK_SIZE = 16  # the engine's default

SHAPES = {}
LLAMA_8B = SHAPES["8b"] = dict(
    hidden_size=4096,
    num_attention_heads=32,
    num_key_value_heads=8,
    intermediate_size=14336,
    vocab_size=128256,
    rope_theta=500000.0,
    rms_norm_eps=1e-5,
    max_position_embeddings=8192,
)


# A shape small enough to run the script's whole path on a CPU (tests/cpu/benchmarks).
SHAPES["test"] = dict(
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    vocab_size=512,
    rope_theta=500000.0,
    rms_norm_eps=1e-5,
    max_position_embeddings=2048,
)


def write_checkpoint(path: Path, layers: int, device: str, shape: dict = LLAMA_8B) -> None:
    """Random bf16 weights in the HF Llama layout; std 0.02 as Llama's init."""
    from safetensors.torch import save_file

    h, inter, vocab = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    kv = h // shape["num_attention_heads"] * shape["num_key_value_heads"]

    dtype = torch.bfloat16 if device == "cuda" else torch.float32  # CPU bf16 matmuls are slow

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, device=device, dtype=dtype) * 0.02).cpu()

    tensors = {"model.embed_tokens.weight": rand(vocab, h), "lm_head.weight": rand(vocab, h)}
    tensors["model.norm.weight"] = torch.ones(h, dtype=dtype)
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors |= {
            p + "self_attn.q_proj.weight": rand(h, h),
            p + "self_attn.k_proj.weight": rand(kv, h),
            p + "self_attn.v_proj.weight": rand(kv, h),
            p + "self_attn.o_proj.weight": rand(h, h),
            p + "mlp.gate_proj.weight": rand(inter, h),
            p + "mlp.up_proj.weight": rand(inter, h),
            p + "mlp.down_proj.weight": rand(h, inter),
            p + "input_layernorm.weight": torch.ones(h, dtype=dtype),
            p + "post_attention_layernorm.weight": torch.ones(h, dtype=dtype),
        }
    save_file(tensors, str(path / "model.safetensors"))
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "num_hidden_layers": layers,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        **shape,
    }
    (path / "config.json").write_text(json.dumps(config))


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed_ms(runner: ModelRunner, batch, steps: int) -> float:
    samples = []
    device = runner.device.type
    for _ in range(steps):
        _sync(device)
        t0 = time.perf_counter()
        runner.forward(batch)
        _sync(device)
        samples.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(samples)


def transformers_decode_ms(path: Path, device: str, batch_size: int, context: int, steps: int) -> float:
    """`transformers` generate on the same checkpoint and device: ms per decode step (greedy,
    `steps` new tokens, less the same call's prefill-only time)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype="auto").to(device).eval()
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (batch_size, context), generator=torch.Generator().manual_seed(1)).to(
        device
    )

    def run(new: int) -> float:
        _sync(device)
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
        _sync(device)
        return time.perf_counter() - t0

    run(2)  # warm-up
    prefill = statistics.median(run(1) for _ in range(3))
    total = statistics.median(run(steps + 1) for _ in range(3))
    return 1e3 * (total - prefill) / steps


def bound_ms(runner: ModelRunner, weights: int, batch_size: int, context: int, bandwidth_tbs: float) -> float:
    """The least time a decode step can take: every weight byte and each sequence's K/V read once."""
    kv = batch_size * context * runner.cache.spec.bytes_per_row()
    return (weights + kv) / (bandwidth_tbs * 1e12) * 1e3


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m outrider.benchmarks.gpu_verify_cost", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--context", type=int, default=512, help="cached prompt tokens per sequence")
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--trees", default="1,4,8,16,32,64")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--bandwidth-tbs", type=float, default=4.8, help="memory bandwidth for the bound")
    parser.add_argument("--device", default="cuda", help="cuda (the benchmark); cpu runs the path (tests)")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="8b", help="model dimensions")
    parser.add_argument("--no-transformers", action="store_true", help="skip the transformers comparison")
    parser.add_argument("--results-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_verify_cost needs a CUDA device (or --device cpu --shape test to try the path)")
    shape = SHAPES[args.shape]
    batches = [int(b) for b in args.batches.split(",")]
    trees = [int(n) for n in args.trees.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        write_checkpoint(Path(tmp), args.layers, args.device, shape)
        weights = sum(f.stat().st_size for f in Path(tmp).glob("*.safetensors"))
        rows_needed = max(batches) * (args.context + max(trees) + BLOCK_SIZE)
        runner = ModelRunner.from_pretrained(
            tmp, max_model_len=args.context + max(trees), kv_cache_rows=rows_needed, device=args.device
        )
        print(f"checkpoint written and loaded in {time.perf_counter() - t0:.1f} s", flush=True)
        rows = measure(runner, args, shape, batches, trees, weights)
        if not args.no_transformers:
            for batch_size in (b for b in batches if b <= 16):
                ms = transformers_decode_ms(Path(tmp), args.device, batch_size, args.context, args.steps)
                rows.append(_row("transformers_generate", batch_size, 1, ms, None, None))
                print(f"transformers generate, batch {batch_size:3d}: {ms:7.2f} ms per step", flush=True)
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else args.device
    write_report(
        "gpu_verify_cost",
        rows,
        {"device": device_name, **{k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}},
        title=f"Verify cost on {device_name}: Llama-3.1-8B shape, {args.layers} layers, bf16",
        notes=(
            f"`python -m outrider.benchmarks.gpu_verify_cost --layers {args.layers} --context {args.context}`: "
            "one runner forward of an n-node tree per sequence after the cached context (paged, 16-slot "
            "blocks), median ms, its ratio to a 1-token decode of the same batch in the same repeat, and a "
            "decode's share of the bandwidth bound; `transformers_generate` rows: ms per greedy decode step "
            "of `generate` on the same checkpoint and device."
        ),
        columns=[
            "method",
            "batch_size",
            "tree_nodes",
            "ms",
            "relative_to_decode",
            "bandwidth_bound_share",
            "tokens_per_s",
        ],
        **({"results_dir": args.results_dir} if args.results_dir else {}),
    )


def _row(method: str, batch_size: int, nodes: int, ms: float, relative, share) -> dict:
    return DecodeRow(
        method=method,
        prompt_set="random",
        temperature=None,
        tokens_per_s=1e3 * batch_size * nodes / ms,
        speedup_vs_plain=None,
        acceptance_length=None,
        extra={
            "batch_size": batch_size,
            "tree_nodes": nodes,
            "ms": ms,
            "relative_to_decode": relative,
            "bandwidth_bound_share": share,
        },
    ).to_dict()


def measure(
    runner: ModelRunner, args, shape: dict, batches: list[int], trees: list[int], weights: int
) -> list[dict]:
    """The runner's verify forwards: every batch size x tree size, interleaved over repeats."""
    gen = torch.Generator().manual_seed(0)
    vocab = shape["vocab_size"]
    blocks = BlockManager(runner.cache.total_rows // BLOCK_SIZE, BLOCK_SIZE, prefix_caching=False)
    tables = []
    for b in range(max(batches)):
        prompt = torch.randint(0, vocab, (args.context,), generator=gen)
        blocks.allocate(b, prompt.tolist(), args.context + max(trees))
        tables.append(blocks.tables[b])
        chunk = SequenceChunk(-1, 0, prompt, blocks=tables[b], block_size=BLOCK_SIZE)
        runner.forward(build_forward_batch([chunk], device=runner.device))
    prepared = {}
    for batch_size in batches:
        for nodes in trees:
            chunks = [
                SequenceChunk(
                    -1, args.context, *random_tree(nodes, vocab, gen), blocks=t, block_size=BLOCK_SIZE
                )
                for t in tables[:batch_size]
            ]
            prepared[batch_size, nodes] = build_forward_batch(chunks, device=runner.device)
    for batch in prepared.values():
        timed_ms(runner, batch, 2)  # warm-up (and any lazy compilation)
    ms: dict[tuple[int, int], list[float]] = {key: [] for key in prepared}
    relative: dict[tuple[int, int], list[float]] = {key: [] for key in prepared}
    for _ in range(args.repeats):
        this = {key: timed_ms(runner, batch, args.steps) for key, batch in prepared.items()}
        for (batch_size, nodes), value in this.items():
            ms[batch_size, nodes].append(value)
            relative[batch_size, nodes].append(value / this[batch_size, min(trees)])
    rows = []
    for (batch_size, nodes), values in ms.items():
        median = statistics.median(values)
        share = (
            bound_ms(runner, weights, batch_size, args.context, args.bandwidth_tbs) / median
            if nodes == 1
            else None
        )
        rows.append(
            _row(
                "verify_forward",
                batch_size,
                nodes,
                median,
                statistics.median(relative[batch_size, nodes]),
                share,
            )
        )
        print(
            f"batch {batch_size:3d} tree {nodes:3d}: {median:7.2f} ms ({rows[-1]['relative_to_decode']:.2f}x decode)",
            flush=True,
        )
    return rows


if __name__ == "__main__":
    main()
