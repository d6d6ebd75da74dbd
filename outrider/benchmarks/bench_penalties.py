"""Acceptance under penalties and logit_bias: drafters that process their q as the target's p, against
drafters that do not (outrider/draft_worker/path_processors.py).

    python -m outrider.benchmarks.bench_penalties --size tiny        # the committed report

Every request carries presence, frequency and repetition penalties and a logit_bias (the
model's likeliest next tokens after a short prompt pushed down). The target applies them at
every tree node with the node's path either way (docs/algorithms.md section 2d), so the output
is the same in distribution, and token for token plain decoding's at T = 0. What changes is q:
`processed` drafters get the processors with each update (the default), `unprocessed` ones see
only temperature/top-k/top-p/min-p, as every drafter did before. `draft_model-as-target` drafts
with the target's own checkpoint: its processed q equals p, the ceiling.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import replace

import torch

from outrider.benchmarks.report import add_run_arguments, write_run_report

PENALTIES = {"presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.2}
NO_PENALTIES = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0}


def drafter(method: str, family) -> dict | None:
    if method == "plain":
        return None
    model = family.target_dir if method.startswith("draft_model-as-target") else family.draft_dir
    spec = {"method": "draft_model", "model": str(model), "num_speculative_tokens": 4}
    if method.endswith("tree"):
        spec |= {"tree_top_k": 3, "tree_max_nodes": 12}
    if method.startswith("eagle3"):
        from outrider.draft_worker.training.demo_heads import ensure_demo_heads

        head = ensure_demo_heads(family, ["eagle3"], progress=False, log=lambda _: None)["eagle3"]
        spec = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 4, "tree_top_k": 3}
        spec["tree_max_nodes"] = 12
    return spec


class Unprocessed:
    """A proposer told only what drafters were told before path processors reached them."""

    def __init__(self, proposer):
        self.proposer = proposer

    def __getattr__(self, name):
        return getattr(self.proposer, name)

    def propose(self, updates):
        from outrider.proto import SamplingParams

        def plain(s: SamplingParams) -> SamplingParams:
            return SamplingParams(s.temperature, s.top_k, s.top_p, s.min_p, s.seed)

        return self.proposer.propose([replace(u, sampling=plain(u.sampling)) for u in updates])


def run_once(runner, prompts, spec, processed, params) -> dict:
    import outrider.draft_worker.draft_model  # noqa: F401 - registers `draft_model`
    import outrider.draft_worker.eagle3  # noqa: F401 - registers `eagle3`
    from outrider.draft_worker import build_proposer
    from outrider.target_worker.draft_source import InProcessDraftSource
    from outrider.target_worker.engine import Engine

    source = None
    if spec is not None:
        proposer = build_proposer(spec, vocab_size=runner.model.vocab_size)
        source = InProcessDraftSource(proposer if processed else Unprocessed(proposer))
    engine = Engine(runner, source, eos_token_id=None, max_batch=len(prompts), budget_policy="fixed")
    completions = engine.generate(prompts, params)
    return {
        "acceptance_length": engine.stats.spec.mean_acceptance_length if spec is not None else None,
        "tokens": [c.token_ids for c in completions],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--methods", default="draft_model-chain,draft_model-tree,eagle3-tree,draft_model-as-target-chain"
    )
    parser.add_argument("--temperatures", default="0,1", type=lambda s: [float(t) for t in s.split(",")])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seed-sets", type=int, default=4, help="batches of fresh seeds at T > 0")
    add_run_arguments(parser, max_tokens=64, prompt_tokens=16)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)

    from outrider.benchmarks.prompts import mid_prompt_ids
    from outrider.demo.family import ensure_demo_family
    from outrider.target_worker.runner import ModelRunner
    from outrider.target_worker.sequence import RequestParams

    family = ensure_demo_family(args.size)
    prompts = mid_prompt_ids(family.tokenizer_dir, args.batch, args.prompt_tokens)
    context = args.prompt_tokens + args.max_tokens + 16
    runner = ModelRunner.from_pretrained(
        family.target_dir, max_model_len=context, kv_cache_rows=args.batch * context
    )
    bias = tuple((t, -2.0) for t in likeliest_tokens(runner, prompts, 8))
    rows = []
    for temperature in args.temperatures:
        # Greedy runs are deterministic; at T = 1 each seed set draws anew (seeds s * batch + i).
        batches = [
            [
                RequestParams(
                    temperature=temperature,
                    seed=s * len(prompts) + i if temperature else None,
                    max_tokens=args.max_tokens,
                    ignore_eos=True,
                    logit_bias=bias,
                    **PENALTIES,
                )
                for i in range(len(prompts))
            ]
            for s in range(args.seed_sets if temperature else 1)
        ]
        free = [[replace(p, logit_bias=(), **NO_PENALTIES) for p in params] for params in batches]
        plain = run_once(runner, prompts, None, True, batches[0])["tokens"] if not temperature else None
        for method in args.methods.split(","):
            spec = drafter(method, family)
            tau, same = {}, {}
            for key, processed, runs in (
                ("free", True, free),
                (False, False, batches),
                (True, True, batches),
            ):
                outs = [run_once(runner, prompts, spec, processed, params) for params in runs]
                tau[key] = statistics.mean(out["acceptance_length"] for out in outs)
                same[key] = all(out["tokens"] == plain for out in outs) if plain is not None else None
            row = {
                "method": method,
                "temperature": temperature,
                "batch": args.batch,
                "seed_sets": len(batches),
                "tau_no_processors": tau["free"],
                "tau_unprocessed": tau[False],
                "tau_processed": tau[True],
                "gain": tau[True] / tau[False],
                "same_as_plain": None if plain is None else f"{same[False]} / {same[True]}",
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    notes = (
        f"Demo family `{args.size}`, {args.batch} `mid` prompts of {args.prompt_tokens} tokens, "
        f"{args.max_tokens} new tokens each (EOS ignored), every request with {PENALTIES} and logit_bias "
        "-2 on the target's 8 likeliest first tokens over the batch. In-process drafters, 4 tokens a round "
        "(trees: top-3, 12 nodes), fixed budgets, one torch thread. tau = output tokens per round "
        "(1 + accepted / drafts): greedy runs once (deterministic); at T = 1 the mean over `seed_sets` "
        f"batches of fresh seeds, the same seeds for every column (the verifier's randomness is keyed per "
        "process, so a rerun draws other tokens: T = 1 gains of a few percent are within run-to-run "
        "variation). `processed`: the drafter gets the penalties and logit_bias with each update (the "
        "default); `unprocessed`: only temperature/top-k/top-p/min-p, as before; verification is the same "
        "in both, only the drafter's q differs. `tau_no_processors`: the same drafter and requests without "
        "penalties or logit_bias. `same_as_plain` (unprocessed / processed, T = 0): the outputs are token "
        "for token plain decoding's under the same processors. At T = 1 a sampled child is drawn from a q "
        "row of 32 entries, so even q = p (`draft_model-as-target`) accepts only the mass of p's top 32."
    )
    write_run_report("penalties", rows, args, title="Drafters that process q as p", notes=notes)
    return 0


def likeliest_tokens(runner, prompts: list[list[int]], count: int) -> list[int]:
    """The target's `count` likeliest first output tokens, summed over the prompts."""
    from outrider.target_worker.batch import SequenceChunk, build_forward_batch

    probs = 0
    for prompt in prompts:
        start = runner.cache.allocate("probe", len(prompt))
        chunk = SequenceChunk(start, 0, torch.tensor(prompt, dtype=torch.int64))
        probs = probs + runner.forward(build_forward_batch([chunk])).logits[-1].float().softmax(-1)
        runner.cache.free("probe")
    return probs.topk(count).indices.tolist()


if __name__ == "__main__":
    sys.exit(main())
