"""Side-by-side 1-token decode latency: this runner vs `transformers` with its KV cache.

Not a test (timings are not asserted): run by hand,

    .venv/bin/python tests/cpu/target_worker/bench_decode_vs_transformers.py [--threads 1]

Random Llama (default: hidden 384, 6 layers, vocab 8192, 16M parameters), fp32, a 128-token prompt,
then 1-token decode steps timed in short interleaved rounds so machine drift hits both alike.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
import transformers

from target_worker.batch import SequenceChunk, build_forward_batch
from target_worker.runner import ModelRunner


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=384)
    parser.add_argument("--layers", type=int, default=6)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=8192,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 8 // 3,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=2 if args.hidden // 64 % 2 == 0 else 1,
        max_position_embeddings=1024,
    )
    ref = transformers.LlamaForCausalLM(config).eval()
    params = sum(p.numel() for p in ref.parameters()) / 1e6
    path = Path(tempfile.mkdtemp())
    ref.save_pretrained(path, safe_serialization=True)
    runner = ModelRunner.from_pretrained(path, max_model_len=1024, kv_cache_rows=1024)
    prompt = torch.randint(0, config.vocab_size, (128,))
    start = runner.cache.allocate(0, 1024)

    def ours(steps: int) -> float:
        out = runner.forward(build_forward_batch([SequenceChunk(start, 0, prompt)]))
        token = out.logits[-1].argmax()
        t0 = time.perf_counter()
        for i in range(steps):
            chunk = SequenceChunk(start, 128 + i, token.view(1))
            token = runner.forward(build_forward_batch([chunk])).logits[-1].argmax()
        return (time.perf_counter() - t0) / steps * 1e3

    @torch.inference_mode()
    def theirs(steps: int) -> float:
        cache = transformers.DynamicCache(config=config)
        out = ref(input_ids=prompt[None], cache=cache, use_cache=True)
        token = out.logits[0, -1].argmax()
        t0 = time.perf_counter()
        for _ in range(steps):
            out = ref(input_ids=token.view(1, 1), cache=cache, use_cache=True)
            token = out.logits[0, -1].argmax()
        return (time.perf_counter() - t0) / steps * 1e3

    ours(8), theirs(8)
    ratios, ms_ours, ms_theirs = [], [], []
    for _ in range(args.rounds):
        a, b = ours(args.steps), theirs(args.steps)
        ms_ours.append(a)
        ms_theirs.append(b)
        ratios.append(b / a)
    print(
        f"{params:.1f}M params, {args.threads} thread(s), 128-token context, {args.steps} steps x {args.rounds}"
    )
    # Other processes share this CPU: the fastest round is the least disturbed one.
    print(f"runner       {min(ms_ours):.2f} ms/token best, {statistics.median(ms_ours):.2f} median")
    print(f"transformers {min(ms_theirs):.2f} ms/token best, {statistics.median(ms_theirs):.2f} median")
    print(
        f"speedup      {min(ms_theirs) / min(ms_ours):.2f}x best-vs-best, "
        f"{statistics.median(ratios):.2f}x median of per-round ratios"
    )


if __name__ == "__main__":
    main()
