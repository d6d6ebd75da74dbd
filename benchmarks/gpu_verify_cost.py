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

LLAMA_8B = dict(
    hidden_size=4096,
    num_attention_heads=32,
    num_key_value_heads=8,
    intermediate_size=14336,
    vocab_size=128256,
    rope_theta=500000.0,
    rms_norm_eps=1e-5,
    max_position_embeddings=8192,
)


def write_checkpoint(path: Path, layers: int, device: str) -> None:
    """Random bf16 weights in the HF Llama layout; std 0.02 as Llama's init."""
    from safetensors.torch import save_file

    h, inter, vocab = LLAMA_8B["hidden_size"], LLAMA_8B["intermediate_size"], LLAMA_8B["vocab_size"]
    kv = h // LLAMA_8B["num_attention_heads"] * LLAMA_8B["num_key_value_heads"]

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, device=device, dtype=torch.bfloat16) * 0.02).cpu()

    tensors = {"model.embed_tokens.weight": rand(vocab, h), "lm_head.weight": rand(vocab, h)}
    tensors["model.norm.weight"] = torch.ones(h, dtype=torch.bfloat16)
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
            p + "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
            p + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
        }
    save_file(tensors, str(path / "model.safetensors"))
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "num_hidden_layers": layers,
        "torch_dtype": "bfloat16",
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        **LLAMA_8B,
    }
    (path / "config.json").write_text(json.dumps(config))


def timed_ms(runner: ModelRunner, batch, steps: int) -> float:
    samples = []
    for _ in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        runner.forward(batch)
        torch.cuda.synchronize()
        samples.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(samples)


def bound_ms(runner: ModelRunner, weights: int, batch_size: int, context: int, bandwidth_tbs: float) -> float:
    """The least time a decode step can take: every weight byte and each sequence's K/V read once."""
    kv = batch_size * context * runner.cache.spec.bytes_per_row()
    return (weights + kv) / (bandwidth_tbs * 1e12) * 1e3


def main() -> None:
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
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_verify_cost needs a CUDA device")
    batches = [int(b) for b in args.batches.split(",")]
    trees = [int(n) for n in args.trees.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        write_checkpoint(Path(tmp), args.layers, "cuda")
        weights = sum(f.stat().st_size for f in Path(tmp).glob("*.safetensors"))
        rows_needed = max(batches) * (args.context + max(trees))
        runner = ModelRunner.from_pretrained(
            tmp, max_model_len=args.context + max(trees), kv_cache_rows=rows_needed, device="cuda"
        )
        print(f"checkpoint written and loaded in {time.perf_counter() - t0:.1f} s", flush=True)
    gen = torch.Generator().manual_seed(0)
    blocks = BlockManager(runner.cache.total_rows // BLOCK_SIZE, BLOCK_SIZE, prefix_caching=False)
    tables = []
    for b in range(max(batches)):
        prompt = torch.randint(0, LLAMA_8B["vocab_size"], (args.context,), generator=gen)
        blocks.allocate(b, prompt.tolist(), args.context + max(trees))
        tables.append(blocks.tables[b])
        chunk = SequenceChunk(-1, 0, prompt, blocks=tables[b], block_size=BLOCK_SIZE)
        runner.forward(build_forward_batch([chunk], device=runner.device))
    prepared = {}
    for batch_size in batches:
        for nodes in trees:
            chunks = [
                SequenceChunk(
                    -1,
                    args.context,
                    *random_tree(nodes, LLAMA_8B["vocab_size"], gen),
                    blocks=t,
                    block_size=BLOCK_SIZE,
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
            relative[batch_size, nodes].append(value / this[batch_size, 1])
    rows = []
    for (batch_size, nodes), values in ms.items():
        row = DecodeRow(
            method="verify_forward",
            prompt_set="random",
            temperature=None,
            tokens_per_s=1e3 * batch_size * nodes / statistics.median(values),
            speedup_vs_plain=None,
            acceptance_length=None,
            extra={
                "batch_size": batch_size,
                "tree_nodes": nodes,
                "ms": statistics.median(values),
                "relative_to_decode": statistics.median(relative[batch_size, nodes]),
                "bandwidth_bound_share": (
                    bound_ms(runner, weights, batch_size, args.context, args.bandwidth_tbs)
                    / statistics.median(values)
                    if nodes == 1
                    else None
                ),
            },
        )
        rows.append(row.to_dict())
        print(
            f"batch {batch_size:3d} tree {nodes:3d}: {statistics.median(values):7.2f} ms "
            f"({statistics.median(relative[batch_size, nodes]):.2f}x decode)",
            flush=True,
        )
    write_report(
        "gpu_verify_cost",
        rows,
        {
            "device": torch.cuda.get_device_name(),
            "layers": args.layers,
            "context": args.context,
            **vars(args),
        },
        title=f"Verify cost on {torch.cuda.get_device_name()}: Llama-3.1-8B shape, {args.layers} layers, bf16",
        notes=(
            f"`python -m outrider.benchmarks.gpu_verify_cost --layers {args.layers} --context {args.context}`: "
            "one runner forward of an n-node tree per sequence after the cached context, median ms, "
            "and its ratio to a 1-token decode of the same batch in the same repeat."
        ),
        columns=[
            "batch_size",
            "tree_nodes",
            "ms",
            "relative_to_decode",
            "bandwidth_bound_share",
            "tokens_per_s",
        ],
    )


if __name__ == "__main__":
    main()
