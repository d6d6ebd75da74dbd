"""Drafting through the engine (in-process draft source) on the tiny demo family.

Greedy output equals speculation off, token for token, for every method; seeded sampling is
reproducible; and sampled tokens follow the target's distribution (a TV test, below).
"""

from __future__ import annotations

import math
import random

import pytest
import torch

import outrider.draft_worker.draft_model  # noqa: F401 - registers `draft_model`
from outrider.benchmarks.prompts import load_prompts
from outrider.draft_worker import build_proposer
from outrider.kernels import process_logits
from outrider.target_worker.batch import SequenceChunk, build_forward_batch
from outrider.target_worker.draft_source import InProcessDraftSource
from outrider.target_worker.draft_trust import VerificationMode
from outrider.target_worker.engine import Engine
from outrider.target_worker.runner import ModelRunner
from outrider.target_worker.sequence import RequestParams
from outrider.target_worker.spec_policy import PolicyConfig, SpeculationPolicy

PROMPT_TOKENS, NEW_TOKENS = 48, 40  # the tiny family's context is 128


def methods(draft_dir) -> dict[str, dict]:
    model = {"method": "draft_model", "model": str(draft_dir), "num_speculative_tokens": 4}
    return {
        "ngram": {
            "method": "ngram",
            "num_speculative_tokens": 4,
            "prompt_lookup_min": 1,
            "prompt_lookup_max": 3,
        },
        "suffix": {"method": "suffix", "num_speculative_tokens": 4},
        "draft_model-chain": model,
        "draft_model-tree": {**model, "tree_top_k": 3, "tree_max_nodes": 12},
    }


@pytest.fixture(scope="module")
def family(tiny_family):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_family.tokenizer_dir)
    prompts = [p.token_ids for p in load_prompts("mid", tokenizer, count=4, prompt_tokens=PROMPT_TOKENS)]
    return tiny_family, prompts


def engine(family_dir, spec: dict | None, max_batch: int = 8, rows: int = 2048, **draft_keys) -> Engine:
    runner = ModelRunner.from_pretrained(family_dir.target_dir, max_model_len=128, kv_cache_rows=rows)
    source = None
    if spec is not None:
        proposer = build_proposer({**spec, **draft_keys}, vocab_size=runner.model.vocab_size)
        source = InProcessDraftSource(proposer)
    return Engine(runner, source, eos_token_id=None, max_batch=max_batch, max_prefill_tokens=rows)


class ShuffledBudgets(SpeculationPolicy):
    """Every sequence gets a random depth in [0, its ceiling] every round: the budgets change
    under the drafter and the verifier all the time, which must never change the output."""

    def __init__(self, ceiling, seed: int = 0):
        super().__init__(ceiling)
        self.rng = random.Random(seed)

    def _depths(self, rows, ceiling, prefill_tokens):
        return [self.rng.randint(0, cap) for cap in ceiling]


def generate(eng: Engine, prompts, params) -> list[list[int]]:
    return [c.token_ids for c in eng.generate(prompts, params)]


@pytest.mark.parametrize("method", ["ngram", "draft_model-tree"])
@pytest.mark.parametrize("policy", ["adaptive", "shuffled"])
def test_greedy_output_is_unchanged_by_budget_policies(family, method, policy):
    fam, prompts = family
    params = RequestParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    plain = generate(engine(fam, None), prompts, params)
    spec_engine = engine(fam, methods(fam.draft_dir)[method])
    if policy == "adaptive":
        spec_engine.policy = SpeculationPolicy(spec_engine.tree_budget, PolicyConfig(warmup_cycles=1))
    else:
        spec_engine.policy = ShuffledBudgets(spec_engine.tree_budget)
    assert generate(spec_engine, prompts, params) == plain
    depths = spec_engine.policy.stats.depth_counts
    assert spec_engine.stats.num_invalid_trees == 0 and sum(depths) > 0
    if policy == "shuffled":
        assert depths[0] > 0 and sum(depths[1:]) > 0 and spec_engine.stats.spec.num_drafts > 0


@pytest.mark.parametrize("method", ["ngram", "suffix", "draft_model-chain", "draft_model-tree"])
def test_greedy_output_equals_speculation_off(family, method):
    fam, prompts = family
    params = RequestParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    plain = generate(engine(fam, None), prompts, params)
    spec_engine = engine(fam, methods(fam.draft_dir)[method])
    assert generate(spec_engine, prompts, params) == plain
    stats = spec_engine.stats
    assert stats.num_invalid_trees == 0 and stats.spec.num_drafts > 0
    if method == "draft_model-tree":
        assert stats.spec.mean_acceptance_length > 1.2  # measured 1.77 on these prompts


@pytest.mark.parametrize("method", ["ngram", "draft_model-chain", "draft_model-tree"])
def test_seeded_sampling_is_reproducible(family, method):
    fam, prompts = family
    spec = methods(fam.draft_dir)[method]
    params = [
        RequestParams(max_tokens=24, temperature=1.0, top_p=0.95, seed=s, ignore_eos=True) for s in range(4)
    ]
    first = generate(engine(fam, spec), prompts, params)
    assert generate(engine(fam, spec), prompts, params) == first
    assert first != generate(engine(fam, None), prompts, RequestParams(max_tokens=24, ignore_eos=True))


def next_token_probs(model_dir, sequences: list[list[int]], start: int, count: int, temperature: float):
    """[N, count, vocab]: the model's p (after `temperature`) of token start + j given the
    tokens before it, for every sequence, from one batched forward."""
    n, length = len(sequences), len(sequences[0])
    runner = ModelRunner.from_pretrained(model_dir, max_model_len=length, kv_cache_rows=n * length)
    chunks = [
        SequenceChunk(runner.cache.allocate(i, length), 0, torch.tensor(s), all_logits=True)
        for i, s in enumerate(sequences)
    ]
    logits = runner.forward(build_forward_batch(chunks)).logits.view(n, length, -1)
    logits = logits[:, start - 1 : start - 1 + count].reshape(n * count, -1)
    return process_logits(logits, torch.full((n * count,), temperature)).view(n, count, -1)


@pytest.mark.parametrize(
    "method,trusted,shuffled",
    [
        ("draft_model-chain", True, False),
        ("draft_model-tree", True, False),
        ("draft_model-tree", False, False),
        ("draft_model-tree", True, True),
    ],
)
def test_first_sampled_tokens_follow_the_target(family, method, trusted, shuffled):
    """N sequences sample K tokens each from one prompt, in one batch, and every token is
    checked against the target's distribution given the prefix actually drawn.

    Given the prefixes, a lossless engine makes the N j-th tokens independent draws from the
    target's p_i. So for a vocabulary set A chosen from the prefixes alone, the frequency
    f(A) is a mean of N independent indicators with mean pbar(A) = mean_i p_i(A), and by
    Hoeffding |f(A) - pbar(A)| <= eps = sqrt(ln(2m / delta) / (2N)) for all m sets at once,
    except with probability delta. Sets: each of the 15 likeliest tokens of pbar (so the TV on
    that partition is <= 15 eps) and the Scheffe set {pbar > qbar}, whose gap would be
    TV(pbar, qbar) if the draft's own distribution leaked into the output: that TV must
    exceed 2 eps, or the test could not tell target from draft. N = 600: eps = 0.099.

    `trusted`: the drafter's q is used (and audited: an honest drafter keeps its trust), or
    its trees are verified as deterministic proposals (`target_worker.draft_trust`).
    `shuffled`: every sequence's draft depth is redrawn every round (`ShuffledBudgets`).
    """
    fam, prompts = family
    n, k, temperature, delta = 600, 4, 1.0, 1e-3
    prompt = prompts[2][:24]
    params = [RequestParams(max_tokens=k, temperature=temperature, seed=s, ignore_eos=True) for s in range(n)]
    eng = engine(
        fam, methods(fam.draft_dir)[method], max_batch=n, rows=n * 48, max_model_len=40, kv_cache_rows=n * 48
    )
    eng.trust.trusted = trusted
    if shuffled:
        eng.policy = ShuffledBudgets(eng.tree_budget, seed=3)
    out = torch.tensor(generate(eng, [prompt] * n, params))  # [N, K]
    assert eng.stats.spec.num_drafts > 0
    if trusted:
        assert eng.trust.mode == VerificationMode.DRAFT_Q and eng.trust.audited_children > 0
    else:
        assert eng.trust.demoted_trees > 0

    sequences = [prompt + row[:-1] for row in out.tolist()]
    p_bar = next_token_probs(fam.target_dir, sequences, len(prompt), k, temperature).mean(0)  # [K, V]
    q_bar = next_token_probs(fam.draft_dir, sequences, len(prompt), k, temperature).mean(0)  # [K, V]
    freq = torch.zeros_like(p_bar).scatter_add_(1, out.T, torch.ones(k, n)) / n  # [K, V]

    top = p_bar.topk(15, dim=1).indices  # [K, 15]
    scheffe = p_bar > q_bar  # [K, V]
    sets_tested = k * 16
    eps = math.sqrt(math.log(2 * sets_tested / delta) / (2 * n))
    bucket_gap = (freq.gather(1, top) - p_bar.gather(1, top)).abs()  # [K, 15]
    scheffe_gap = ((freq - p_bar) * scheffe).sum(1).abs()  # [K]
    assert bool((bucket_gap <= eps).all()), (bucket_gap.max(), eps)
    assert bool((scheffe_gap <= eps).all()), (scheffe_gap, eps)
    tv_draft = 0.5 * (p_bar - q_bar).abs().sum(1)  # [K] = the Scheffe set's gap if q leaked
    assert float(tv_draft[1:].max()) > 2 * eps, (tv_draft, eps)
