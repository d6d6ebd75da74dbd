"""The engine over its paged KV cache: admission without reserving max_tokens, preemption by
recompute, and prefix caching, each leaving greedy output unchanged."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from outrider.draft_worker import build_proposer
from outrider.target_worker.draft_source import InProcessDraftSource
from outrider.target_worker.engine import Engine
from outrider.target_worker.runner import ModelRunner
from outrider.target_worker.sequence import RequestParams


@pytest.fixture(scope="module")
def roomy(tiny_family):
    return ModelRunner.from_pretrained(tiny_family.target_dir, max_model_len=128, kv_cache_rows=4096)


def _prompts(vocab: int, count: int, length: int, prefix: list[int] | None = None) -> list[list[int]]:
    gen = torch.Generator().manual_seed(count)
    head = prefix or []
    return [head + torch.randint(0, vocab, (length,), generator=gen).tolist() for _ in range(count)]


def _run(engine: Engine, prompts: list[list[int]], params: RequestParams) -> tuple[list[list[int]], int]:
    """Outputs in prompt order, and the most sequences that ran at once."""
    ids = [engine.add_request(p, params) for p in prompts]
    tokens: dict[int, list[int]] = {i: [] for i in ids}
    most = 0
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
        most = max(most, len(engine.running))
    assert not engine.blocks.tables  # every block table was handed back
    return [tokens[i] for i in ids], most


@pytest.mark.parametrize("speculate", [False, True], ids=["plain", "ngram"])
def test_admission_takes_blocks_as_sequences_grow(tiny_family, roomy, speculate):
    """12 requests of 16 prompt tokens and max_tokens 40 (55 slots each at the end) in a cache
    of 24 blocks (384 slots): extents sized for max_tokens would admit 6; blocks admit all 12,
    preempt the youngest as the others grow, and the outputs equal a roomy cache's."""
    vocab = roomy.model.vocab_size
    prompts, params = _prompts(vocab, 12, 16), RequestParams(max_tokens=40)
    expected, _ = _run(Engine(roomy, eos_token_id=None, max_batch=16), prompts, params)
    tight = ModelRunner.from_pretrained(tiny_family.target_dir, max_model_len=128, kv_cache_rows=384)
    source = None
    if speculate:
        config = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}
        source = InProcessDraftSource(build_proposer(config, vocab_size=vocab))
    engine = Engine(tight, source, eos_token_id=None, max_batch=16, max_prefill_tokens=256)
    got, most = _run(engine, prompts, params)
    assert most == 12
    assert engine.stats.num_preemptions > 0
    assert got == expected


def test_a_shared_prefix_is_prefilled_once(roomy):
    """Requests sharing a 64-token prefix: after the first, each prefills only its own suffix
    (prefix-cache hits counted in tokens, as vLLM counts them); outputs equal caching off."""
    vocab = roomy.model.vocab_size
    prefix = _prompts(vocab, 1, 64)[0]
    prompts, params = _prompts(vocab, 5, 8, prefix=prefix), RequestParams(max_tokens=6)
    outputs = {}
    for caching in (False, True):
        engine = Engine(roomy, eos_token_id=None, max_batch=8, prefix_caching=caching)
        first, _ = _run(engine, prompts[:1], params)  # the first request fills the cache
        rest, _ = _run(engine, prompts[1:], params)
        outputs[caching] = (first + rest, engine.stats.num_prefill_tokens, engine.blocks.stats)
    assert outputs[True][0] == outputs[False][0]
    assert outputs[False][1] == 5 * 72
    assert outputs[True][1] == 72 + 4 * 8  # the four later requests prefill their 8-token suffixes
    assert outputs[True][2].hits == 4 * 64 and outputs[True][2].queries == 5 * 72
    assert outputs[False][2].queries == 0


@pytest.mark.parametrize("speculate", [False, True], ids=["plain", "ngram"])
def test_a_request_resumed_with_its_output_continues_it(roomy, speculate):
    """A choice resumed elsewhere (`add_request(..., output_token_ids=emitted)`, what the ingress
    sends when a replica dies) continues exactly where it stopped, also when what it does
    depends on the output so far: a frequency penalty counts the emitted tokens."""
    vocab = roomy.model.vocab_size
    prompt = _prompts(vocab, 1, 12)[0]
    params = RequestParams(max_tokens=24, frequency_penalty=1.5, temperature=0.0)
    whole, _ = _run(Engine(roomy, eos_token_id=None), [prompt], params)
    source = None
    if speculate:
        config = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}
        source = InProcessDraftSource(build_proposer(config, vocab_size=vocab))
    engine = Engine(roomy, source, eos_token_id=None)
    request = engine.add_request(prompt, params, output_token_ids=whole[0][:10])
    rest = [t for out in engine.stream() if out.request_id == request for t in out.new_token_ids]
    assert rest == whole[0][10:]
    # Taken as prompt instead, the penalty would not count them: another continuation.
    as_prompt, _ = _run(
        Engine(roomy, eos_token_id=None), [prompt + whole[0][:10]], replace(params, max_tokens=14)
    )
    assert as_prompt[0] != rest
