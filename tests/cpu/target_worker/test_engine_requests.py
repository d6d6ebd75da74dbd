"""Engine request handling on the tiny demo target: stop rules, admission, arrivals, aborts.

Each expectation is derived from a plain greedy reference run of the same prompt, and each
check runs with speculation off and with prompt lookup on (several tokens per round, so a
stop can fall in the middle of a round's output).
"""

from __future__ import annotations

import pytest
import torch

from outrider.draft_worker import build_proposer
from outrider.target_worker.draft_source import InProcessDraftSource
from outrider.target_worker.engine import Engine
from outrider.target_worker.kv_cache import CacheFullError
from outrider.target_worker.runner import ModelRunner
from outrider.target_worker.sequence import RequestParams

LONG = 40  # reference length


@pytest.fixture(scope="module")
def runner(tiny_family):
    return ModelRunner.from_pretrained(tiny_family.target_dir, max_model_len=128, kv_cache_rows=2048)


@pytest.fixture(scope="module")
def prompts(runner):
    gen = torch.Generator().manual_seed(1)
    return [
        torch.randint(0, runner.model.vocab_size, (n,), generator=gen).tolist() for n in (4, 11, 30, 18, 2)
    ]


@pytest.fixture(scope="module")
def reference(runner, prompts):
    """Plain greedy continuations, one prompt at a time."""
    engine = Engine(runner, eos_token_id=None)
    return [engine.generate([p], RequestParams(max_tokens=LONG))[0].token_ids for p in prompts]


def make_engine(runner, speculate: bool, **kwargs) -> Engine:
    source = None
    if speculate:
        config = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}
        source = InProcessDraftSource(build_proposer(config, vocab_size=runner.model.vocab_size))
    return Engine(runner, source, **({"eos_token_id": None, "max_prefill_tokens": 16} | kwargs))


@pytest.mark.parametrize("speculate", [False, True])
def test_max_tokens(runner, prompts, reference, speculate):
    engine = make_engine(runner, speculate)
    limits = [1, 2, 7, 13, LONG]
    out = engine.generate(prompts, [RequestParams(max_tokens=n) for n in limits])
    for completion, ref, n in zip(out, reference, limits, strict=True):
        assert completion.token_ids == ref[:n]
        assert completion.finish_reason == "length" and completion.stop_reason is None


@pytest.mark.parametrize("speculate", [False, True])
def test_eos_stops_and_is_not_emitted(runner, prompts, reference, speculate):
    ref = reference[2]
    cut = next(i for i in range(3, LONG) if ref[i] not in ref[:i])  # a token's first appearance
    eos = ref[cut]
    engine = make_engine(runner, speculate, eos_token_id=eos)
    stopped, ignored = engine.generate(
        [prompts[2], prompts[2]],
        [RequestParams(max_tokens=LONG), RequestParams(max_tokens=LONG, ignore_eos=True)],
    )
    assert stopped.token_ids == ref[:cut]
    assert (stopped.finish_reason, stopped.stop_reason) == ("stop", eos)
    assert ignored.token_ids == ref and ignored.finish_reason == "length"


@pytest.mark.parametrize("speculate", [False, True])
def test_stop_string_spanning_tokens(runner, tokenizer, prompts, reference, speculate):
    def detokenize(ids: list[int]) -> str:
        return tokenizer.decode(ids)

    ref = next(r for r in reference if len(set(r[:8])) >= 4)  # not a loop of one token
    ref_text = detokenize(ref)
    boundary = len(detokenize(ref[:6]))
    stop = ref_text[boundary - 1 : boundary + 1]  # the last character of one token, the first of the next
    at = ref_text.find(stop)
    # The shortest output whose text holds the stop string: tokens past it are never emitted.
    emitted = next(j for j in range(1, LONG + 1) if stop in detokenize(ref[:j]))
    engine = make_engine(runner, speculate, detokenize=detokenize)
    request_id = engine.add_request(
        prompts[reference.index(ref)], RequestParams(max_tokens=LONG, stop=("@@", stop))
    )
    streamed, last = [], None
    for out in engine.stream():
        assert out.request_id == request_id
        streamed += out.new_token_ids
        last = out
    assert streamed == ref[:emitted]
    assert (last.finished, last.finish_reason, last.stop_reason) == (True, "stop", stop)
    assert last.text == ref_text[:at]


def test_admission_refuses_what_can_never_fit(tiny_family, runner, prompts):
    engine = make_engine(runner, speculate=False)
    with pytest.raises(CacheFullError, match=r"needs 139 KV rows .*max_model_len 128"):
        engine.add_request(prompts[2], RequestParams(max_tokens=110))
    small = ModelRunner.from_pretrained(tiny_family.target_dir, max_model_len=128, kv_cache_rows=40)
    with pytest.raises(CacheFullError, match=r"needs 41 KV rows .*KV cache 32 slots"):
        Engine(small, eos_token_id=None).add_request(prompts[2], RequestParams(max_tokens=12))
    with pytest.raises(ValueError, match="at least one token"):
        engine.add_request([])
    with pytest.raises(ValueError, match="must be in"):
        engine.add_request([runner.model.vocab_size])
    with pytest.raises(ValueError, match="detokenize"):
        engine.add_request(prompts[0], RequestParams(stop=("\n",)))
    with pytest.raises(ValueError, match="top_p"):
        RequestParams(top_p=0.0)
    assert not engine.has_unfinished()


@pytest.mark.parametrize("speculate", [False, True])
def test_requests_wait_for_kv_rows(tiny_family, prompts, reference, speculate):
    """A cache of 9 blocks (144 slots) serves five prompts (65 tokens) with 30 new tokens each
    (215 slots): sequences are admitted while their blocks fit with headroom to grow, the others
    wait for blocks to free up, and the outputs are unchanged."""
    small = ModelRunner.from_pretrained(tiny_family.target_dir, max_model_len=128, kv_cache_rows=150)
    engine = make_engine(small, speculate)
    params = RequestParams(max_tokens=30)
    ids = [engine.add_request(p, params) for p in prompts]
    tokens = {i: [] for i in ids}
    most_running = 0
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
        most_running = max(most_running, len(engine.running))
    assert 1 < most_running < len(prompts)
    assert [tokens[i] for i in ids] == [r[:30] for r in reference]
    assert not engine.blocks.tables and engine.blocks.num_free_blocks == engine.blocks.num_blocks


@pytest.mark.parametrize("speculate", [False, True])
def test_requests_added_mid_flight(runner, prompts, reference, speculate):
    engine = make_engine(runner, speculate)
    params = RequestParams(max_tokens=20)
    tokens: dict[int, list[int]] = {}
    ids = [engine.add_request(p, params) for p in prompts[:2]]
    for _ in range(3):
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert all(tokens[i] for i in ids)  # both are decoding when the others arrive
    ids += [engine.add_request(p, params) for p in prompts[2:]]
    for out in engine.stream():
        tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert [tokens[i] for i in ids] == [r[:20] for r in reference]


class RecordingSource(InProcessDraftSource):
    def __init__(self, proposer):
        super().__init__(proposer)
        self.submitted = []

    def submit(self, updates):
        self.submitted += updates
        super().submit(updates)


def test_abort_frees_the_sequence_and_tells_the_drafter(runner, prompts, reference):
    config = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}
    source = RecordingSource(build_proposer(config, vocab_size=runner.model.vocab_size))
    engine = Engine(runner, source, eos_token_id=None)
    params = RequestParams(max_tokens=LONG)
    kept, aborted = engine.add_request(prompts[0], params), engine.add_request(prompts[1], params)
    tokens = []
    for _ in range(3):
        tokens += [t for out in engine.step() if out.request_id == kept for t in out.new_token_ids]
    engine.abort_request(aborted)
    assert [s.seq_id for s in engine.running] == [kept]
    assert any(u.seq_id == aborted and u.finished for u in source.submitted)
    for out in engine.stream():
        assert out.request_id == kept
        tokens += out.new_token_ids
    assert tokens == reference[0]
    assert not engine.blocks.tables and engine.blocks.num_free_blocks == engine.blocks.num_blocks
