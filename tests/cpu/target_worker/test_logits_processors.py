"""Path-dependent logit processors (penalties, logit_bias, min_tokens), stop ids and logprobs.

Three layers: each tree node's processed row against a naive reference that decodes the
node's path step by step (scenario, hand-built logits); the engine's greedy output with
penalties against a naive decoding loop; and speculation on == off, token for token and
logprob for logprob (1e-4), with n-gram drafting, which proposes exactly the repeated tokens
penalties act on.
"""

from __future__ import annotations

import pytest
import torch

from outrider.draft_worker import build_proposer
from outrider.proto import SamplingParams
from outrider.target_worker.batch import SequenceChunk, build_forward_batch
from outrider.target_worker.draft_source import InProcessDraftSource
from outrider.target_worker.engine import Engine
from outrider.target_worker.logits_processors import process_tree_rows
from outrider.target_worker.runner import ModelRunner
from outrider.target_worker.sequence import RequestParams, Sequence

PENALTIES = {
    "presence": {"presence_penalty": 1.5},
    "frequency": {"frequency_penalty": 1.0},
    "repetition": {"repetition_penalty": 1.8},
    "all": {"presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.3},
}


def reference_row(logits: torch.Tensor, prompt: list[int], output: list[int], params: RequestParams):
    """vLLM's processors for one row, written out token by token: the reference."""
    row = logits.clone()
    for token, bias in params.logit_bias:
        row[token] += bias
    if len(output) < params.min_tokens:
        for token in params.stop_token_ids:
            row[token] = -torch.inf
    for token in set(prompt) | set(output):
        if params.repetition_penalty != 1.0:
            r = params.repetition_penalty
            row[token] = row[token] / r if row[token] > 0 else row[token] * r
    for token in set(output):
        row[token] -= params.frequency_penalty * output.count(token) + params.presence_penalty
    return row


def make_seq(params: RequestParams, prompt: list[int], output: list[int]) -> Sequence:
    seq = Sequence(0, params, prompt + output, len(prompt), None, SamplingParams())
    seq.stop_ids = frozenset(params.stop_token_ids)
    return seq


@pytest.mark.parametrize("penalty", [3.25e-187, 1e-40, 1e-30])
def test_a_vanishing_repetition_penalty_leaves_every_row_a_distribution(penalty):
    """Any repetition_penalty > 0 is accepted (vLLM's rule). One under float32's range (the
    HTTP fuzzer sent 3.25e-187) was 0 there: a seen token's positive logit became inf, the
    row's softmax NaN, and the request a 500. Seen tokens with positive logits now tie at
    the largest finite logit; every row stays finite and normalisable."""
    params = RequestParams(temperature=1.0, repetition_penalty=penalty)
    rows = torch.tensor([[2.0, 3.0, -1.0, 0.5, 0.0, 1.0]] * 3)
    got = process_tree_rows(make_seq(params, [1, 3], [1]), rows.clone(), torch.tensor([1, 3, 4]), [-1, 0, 0])
    assert torch.isfinite(got).all()
    probs = torch.softmax(got, dim=-1)
    assert torch.isfinite(probs).all() and torch.allclose(probs.sum(-1), torch.ones(3))
    assert (probs[:, [0, 2, 4, 5]] == 0).all()  # unseen tokens: swamped, as the reference's limit


@pytest.mark.parametrize("name", [*PENALTIES, "bias_and_min_tokens"])
def test_each_node_is_processed_with_its_own_path(name):
    """A tree with branches and repeated tokens: every node's row equals the reference
    computed from committed tokens + that node's path, and differs from the row that
    counts the committed tokens only (what SGLang does) wherever the path matters."""
    vocab = 12
    extra = {"logit_bias": ((3, 2.5), (7, -1.0)), "min_tokens": 5, "stop_token_ids": (2, 9)}
    params = RequestParams(temperature=1.0, **PENALTIES.get(name, extra))
    prompt, output = [1, 4, 4, 5], [5, 6]  # root = 6
    #        0(root 6)
    #       /    |    \
    #     1:5   2:4   3:8
    #     |  \         |
    #   4:5  5:6      6:8
    #    |
    #   7:5
    tokens = torch.tensor([6, 5, 4, 8, 5, 6, 8, 5])
    parents = [-1, 0, 0, 0, 1, 1, 3, 4]
    rows = torch.randn(len(tokens), vocab, generator=torch.Generator().manual_seed(0))
    got = process_tree_rows(make_seq(params, prompt, output), rows.clone(), tokens, parents)
    committed_only = process_tree_rows(make_seq(params, prompt, output), rows[:1].clone(), tokens[:1], [-1])
    differs = 0
    for node in range(len(tokens)):
        path, u = [], node
        while u > 0:
            path.insert(0, int(tokens[u]))
            u = parents[u]
        want = reference_row(rows[node], prompt, output + path, params)
        torch.testing.assert_close(got[node], want, rtol=1e-6, atol=1e-6)
        differs += not torch.allclose(committed_only[0], want)
    # The path changes the row (at most nodes for penalties; past min_tokens' depth for the
    # stop ids), so a processor that counts the committed tokens only fails this test.
    assert differs >= (5 if name in PENALTIES else 1)


def naive_greedy(runner: ModelRunner, prompt: list[int], params: RequestParams, steps: int) -> list[int]:
    """Greedy decoding by full forwards, the penalties applied by `reference_row`."""
    output: list[int] = []
    for _ in range(steps):
        tokens = prompt + output
        chunk = SequenceChunk(runner.cache.allocate(0, len(tokens)), 0, torch.tensor(tokens))
        logits = runner.forward(build_forward_batch([chunk])).logits[-1]
        runner.cache.free(0)
        output.append(int(reference_row(logits.float(), prompt, output, params).argmax()))
    return output


@pytest.fixture(scope="module")
def runner(tiny_family):
    return ModelRunner.from_pretrained(tiny_family.target_dir, max_model_len=128, kv_cache_rows=4096)


@pytest.fixture(scope="module")
def prompts(runner):
    """Random tokens, each prompt a phrase said three times: n-gram drafting has repeats to
    propose, and penalties have repeats to act on."""
    gen = torch.Generator().manual_seed(2)
    phrases = [torch.randint(3, runner.model.vocab_size, (n,), generator=gen).tolist() for n in (9, 13, 7)]
    return [phrase * 3 for phrase in phrases]


def drafter(method: str, family) -> dict:
    """The drafters these tests run with: prompt lookup, the draft LM (tree) and EAGLE-3 (tree)."""
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}
    tree = {"num_speculative_tokens": 4, "tree_top_k": 2, "tree_max_nodes": 10}
    if method == "draft_model":
        import outrider.draft_worker.draft_model  # noqa: F401 - registers `draft_model`

        return {"method": "draft_model", "model": str(family.draft_dir), **tree}
    from outrider.draft_worker.training.demo_heads import ensure_demo_heads

    head = ensure_demo_heads(family, ["eagle3"], progress=False, log=lambda _: None)["eagle3"]
    return {"method": "eagle3", "model": str(head), **tree}


def engine(runner, speculate: str | None, family=None, **kwargs) -> Engine:
    source = None
    if speculate:
        proposer = build_proposer(drafter(speculate, family), vocab_size=runner.model.vocab_size)
        source = InProcessDraftSource(proposer)
    return Engine(runner, source, **({"eos_token_id": None, "max_batch": 8} | kwargs))


def run(eng: Engine, prompts, params):
    ids = [eng.add_request(p, params) for p in prompts]
    tokens = {i: [] for i in ids}
    logprobs = {i: [] for i in ids}
    for out in eng.stream():
        tokens[out.request_id] += out.new_token_ids
        logprobs[out.request_id] += out.logprobs or []
    return [tokens[i] for i in ids], [logprobs[i] for i in ids]


def test_greedy_penalties_match_naive_decoding(runner, prompts):
    params = RequestParams(max_tokens=16, ignore_eos=True, **PENALTIES["all"])
    got, _ = run(engine(runner, None), prompts[:1], params)
    assert got[0] == naive_greedy(runner, prompts[0], params, 16)


@pytest.mark.parametrize("speculate", ["ngram", "draft_model", "eagle3"])
def test_greedy_with_processors_and_logprobs_equals_speculation_off(runner, prompts, tiny_family, speculate):
    """Penalties on repeated text are where a path-blind verifier goes wrong: n-gram drafts
    are repeats by construction. Tokens equal, logprobs and top-5 equal to 1e-4."""
    for name, penalty in PENALTIES.items():
        params = RequestParams(max_tokens=32, ignore_eos=True, logprobs=5, **penalty)
        plain, plain_lp = run(engine(runner, None), prompts, params)
        spec_engine = engine(runner, speculate, tiny_family)
        spec, spec_lp = run(spec_engine, prompts, params)
        assert spec == plain, name
        assert spec_engine.stats.spec.num_drafts > 0
        for a_seq, b_seq in zip(plain_lp, spec_lp, strict=True):
            assert len(a_seq) == len(b_seq) == 32
            for a, b in zip(a_seq, b_seq, strict=True):
                assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-4
                assert [t for t, _ in a.top] == [t for t, _ in b.top]
                assert max(abs(x - y) for (_, x), (_, y) in zip(a.top, b.top, strict=True)) < 1e-4


def test_logprobs_are_the_processed_distribution(runner, prompts):
    """The chosen token is the top-1 under greedy, and logit_bias shows in the logprobs."""
    params = RequestParams(max_tokens=6, ignore_eos=True, logprobs=3, logit_bias=((7, 100.0),))
    tokens, logprobs = run(engine(runner, None), prompts[:1], params)
    assert tokens[0] == [7] * 6
    assert all(e.top[0][0] == 7 and e.logprob > -1e-3 for e in logprobs[0])


@pytest.mark.parametrize("speculate", [None, "ngram"])
def test_stop_ids_min_tokens_and_several_eos(runner, prompts, speculate):
    long, _ = run(engine(runner, None), prompts[:1], RequestParams(max_tokens=30, ignore_eos=True))
    ref = long[0]
    # Two EOS ids: the second one stops the sequence (and is not emitted).
    eos_a, eos_b = 2047, ref[5]
    first = ref.index(eos_b)
    out, _ = run(
        engine(runner, speculate, eos_token_id=[eos_a, eos_b]), prompts[:1], RequestParams(max_tokens=30)
    )
    assert out[0] == ref[:first]
    # stop_token_ids stop it; ignore_eos does not ignore them.
    params = RequestParams(max_tokens=30, ignore_eos=True, stop_token_ids=(eos_b,))
    out, _ = run(engine(runner, speculate, eos_token_id=[eos_a]), prompts[:1], params)
    assert out[0] == ref[:first]
    # min_tokens: the stop id is masked until `first + 3` tokens are out.
    params = RequestParams(max_tokens=30, stop_token_ids=(eos_b,), min_tokens=first + 3)
    out, _ = run(engine(runner, speculate), prompts[:1], params)
    assert len(out[0]) >= first + 3 and eos_b not in out[0][: first + 3]


@pytest.mark.parametrize("speculate", [None, "ngram"])
def test_prompt_logprobs_over_chunked_prefill(runner, prompts, speculate):
    """Echo's prompt logprobs: one per prompt token after the first, the same whatever the
    prefill chunking (7 tokens a round here) and however many requests share the forward."""
    eng = engine(runner, speculate, max_prefill_tokens=7)
    ids = [eng.add_request(p, RequestParams(max_tokens=3, prompt_logprobs=2, logprobs=0)) for p in prompts]
    got = {}
    for out in eng.stream():
        if out.prompt_logprobs is not None:
            got[out.request_id] = out.prompt_logprobs
    for i, prompt in zip(ids, prompts, strict=True):
        chunk = SequenceChunk(
            runner.cache.allocate(99, len(prompt)), 0, torch.tensor(prompt), all_logits=True
        )
        logp = torch.log_softmax(runner.forward(build_forward_batch([chunk])).logits.float(), -1)
        runner.cache.free(99)
        assert [e.token_id for e in got[i]] == prompt[1:]
        want = logp[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
        assert torch.allclose(torch.tensor([e.logprob for e in got[i]]), want, atol=1e-4)
        assert all(len(e.top) == 2 and e.top[0][1] >= e.logprob - 1e-6 for e in got[i])
