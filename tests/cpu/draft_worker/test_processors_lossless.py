"""Sampled output with penalties, min_p and logit_bias follows the processed target, with drafting on.

The drafter's q knows nothing of the penalties (it is drawn from the draft model's plain
distribution), so every tree is a proposal from a distribution far from p: verification must
still emit exactly the processed target's distribution, penalties counted along each path.
Same test as `test_engine_drafting.test_first_sampled_tokens_follow_the_target` (Hoeffding
bounds on the likeliest tokens and the Scheffe set, N = 600 seeded samples of the first K
tokens), against a reference that processes each prefix step by step; its power is checked
against the distribution *without* the processors, which a verifier that dropped or
miscounted them would drift towards.
"""

from __future__ import annotations

import math

import pytest
import torch

import outrider.draft_worker.draft_model  # noqa: F401 - registers `draft_model`
from outrider.draft_worker import build_proposer
from outrider.kernels import process_logits
from outrider.target_worker.batch import SequenceChunk, build_forward_batch
from outrider.target_worker.draft_source import InProcessDraftSource
from outrider.target_worker.engine import Engine
from outrider.target_worker.runner import ModelRunner
from outrider.target_worker.sequence import RequestParams

CASES = {
    "penalties": {"presence_penalty": 1.5, "frequency_penalty": 1.0, "repetition_penalty": 2.0},
    "min_p_and_logit_bias": {"min_p": 0.05, "logit_bias": ((5, 3.0), (9, 2.0), (17, -4.0))},
}


def reference_probs(model_dir, prompt, out, params: RequestParams, processed: bool) -> torch.Tensor:
    """[N, K, vocab]: p of token j given prompt + out[:j], processed step by step (or not)."""
    n, k = out.shape
    sequences = [prompt + row[:-1] for row in out.tolist()]
    length = len(sequences[0])
    runner = ModelRunner.from_pretrained(model_dir, max_model_len=length, kv_cache_rows=n * length)
    chunks = [
        SequenceChunk(runner.cache.allocate(i, length), 0, torch.tensor(s), all_logits=True)
        for i, s in enumerate(sequences)
    ]
    logits = runner.forward(build_forward_batch(chunks)).logits.view(n, length, -1)
    logits = logits[:, len(prompt) - 1 :].float().clone()  # [N, K, V]
    if processed:
        for i in range(n):
            for j in range(k):
                logits[i, j] = process_row(logits[i, j], prompt, out[i, :j].tolist(), params)
    flat = logits.reshape(n * k, -1)
    rows = n * k
    min_p = torch.full((rows,), params.min_p if processed else 0.0)
    return process_logits(flat, torch.full((rows,), params.temperature), min_p=min_p).view(n, k, -1)


def process_row(
    row: torch.Tensor, prompt: list[int], output: list[int], params: RequestParams
) -> torch.Tensor:
    """vLLM's logit_bias, then repetition, frequency and presence penalties, token by token."""
    for token, bias in params.logit_bias:
        row[token] += bias
    r = params.repetition_penalty
    for token in set(prompt) | set(output):
        row[token] = row[token] / r if row[token] > 0 else row[token] * r
    for token in set(output):
        row[token] -= params.frequency_penalty * output.count(token) + params.presence_penalty
    return row


@pytest.mark.parametrize("case", sorted(CASES))
def test_sampled_tokens_follow_the_processed_target(tiny_family, case):
    n, k, delta = 600, 4, 1e-3
    runner = ModelRunner.from_pretrained(tiny_family.target_dir, max_model_len=40, kv_cache_rows=n * 48)
    # The model's own greedy text: tokens it likes, and loops, so penalties move real mass.
    seed_tokens = torch.randint(3, 2048, (4,), generator=torch.Generator().manual_seed(5)).tolist()
    greedy = Engine(runner, eos_token_id=None).generate(
        [seed_tokens], RequestParams(max_tokens=20, ignore_eos=True)
    )
    prompt = seed_tokens + greedy[0].token_ids
    params = [
        RequestParams(max_tokens=k, temperature=1.0, seed=s, ignore_eos=True, **CASES[case]) for s in range(n)
    ]
    config = {"method": "draft_model", "model": str(tiny_family.draft_dir), "num_speculative_tokens": 3}
    proposer = build_proposer(
        {**config, "tree_top_k": 2, "tree_max_nodes": 8}, vocab_size=runner.model.vocab_size
    )
    eng = Engine(
        runner, InProcessDraftSource(proposer), eos_token_id=None, max_batch=n, max_prefill_tokens=n * 48
    )
    out = torch.tensor([c.token_ids for c in eng.generate([prompt] * n, params)])  # [N, K]
    assert eng.stats.spec.num_drafts > 0 and eng.stats.spec.num_accepted_tokens > 0

    p_bar = reference_probs(tiny_family.target_dir, prompt, out, params[0], processed=True).mean(0)  # [K, V]
    plain = reference_probs(tiny_family.target_dir, prompt, out, params[0], processed=False).mean(0)
    freq = torch.zeros_like(p_bar).scatter_add_(1, out.T, torch.ones(k, n)) / n  # [K, V]
    top = p_bar.topk(15, dim=1).indices  # [K, 15]
    scheffe = p_bar > plain  # [K, V]
    eps = math.sqrt(math.log(2 * k * 16 / delta) / (2 * n))
    bucket_gap = (freq.gather(1, top) - p_bar.gather(1, top)).abs()  # [K, 15]
    scheffe_gap = ((freq - p_bar) * scheffe).sum(1).abs()  # [K]
    assert bool((bucket_gap <= eps).all()), (bucket_gap.max(), eps)
    assert bool((scheffe_gap <= eps).all()), (scheffe_gap, eps)
    tv_plain = 0.5 * (p_bar - plain).abs().sum(1)  # [K] = the Scheffe set's gap without processors
    assert float(tv_plain.max()) > 2 * eps, (tv_plain, eps)
