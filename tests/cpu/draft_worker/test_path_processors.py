"""Drafters process their q as the target processes p (outrider/draft_worker/path_processors.py): each q
row a draft_model sends under penalties, logit_bias and min_tokens is the target's own
processing (`target_worker.logits_processors`) of the draft LM's logits after that row's path,
counts along the path included; and the fields reach the drafter through the wire."""

from __future__ import annotations

import pytest
import torch
from test_draft_model import CHAIN, TREE, contexts, make, path_to, plain_forward, update

from outrider.draft_worker.path_processors import DraftProcessors
from outrider.kernels import process_logits
from outrider.proto import CandidateTree, SamplingParams, SequenceUpdate
from outrider.proto import outrider_pb2 as pb
from outrider.target_worker.logits_processors import process_tree_rows
from outrider.target_worker.sequence import RequestParams, Sequence

PENALTIES = dict(presence_penalty=0.8, frequency_penalty=0.6, repetition_penalty=1.4)


@pytest.fixture(scope="module")
def draft_dir(tiny_family):
    return tiny_family.draft_dir


@pytest.fixture(scope="module")
def reference(draft_dir):
    return plain_forward(draft_dir)


def settings(ctx: list[int], next_logits, temperature: float) -> tuple[RequestParams, SamplingParams]:
    """Every processor, each made to bite: the draft's second and third likeliest first tokens
    biased down and up, its likeliest one and 20 more stop ids under min_tokens = 5 (the output is
    3 tokens: masked at depths 0 and 1, open from depth 2)."""
    top = next_logits(ctx).topk(24).indices.tolist()
    params = RequestParams(
        temperature=temperature,
        top_p=0.95 if temperature else 1.0,
        seed=1 if temperature else None,
        min_tokens=5,
        logit_bias=((top[1], -3.0), (top[2], 2.5)),
        **PENALTIES,
    )
    sampling = SamplingParams(
        temperature=temperature,
        top_p=params.top_p,
        seed=params.seed,
        logit_bias=params.logit_bias,
        min_tokens=5,
        stop_ids=tuple(sorted([top[0], *top[3:]])),
        num_prompt=len(ctx) - 3,
        **PENALTIES,
    )
    return params, sampling


def expected_q(ctx: list[int], path: list[int], params: RequestParams, sampling, next_logits) -> torch.Tensor:
    """The target's processing of the draft's logits after ctx + path, as plain decoding sees it
    once it has emitted the path (a root-only tree), then the sampling transforms."""
    tokens = ctx + path
    seq = Sequence(0, params, tokens, sampling.num_prompt, None, sampling)
    seq.stop_ids = frozenset(sampling.stop_ids)
    row = process_tree_rows(seq, next_logits(tokens)[None].float().clone(), [tokens[-1]], [-1])
    if sampling.greedy:
        return row.softmax(-1)[0]
    s = sampling
    return process_logits(row, *(torch.tensor([v]) for v in (s.temperature, s.top_k, s.top_p, s.min_p)))[0]


def assert_processed_q(tree: CandidateTree, ctx, params, sampling, next_logits) -> None:
    k = tree.q_token_ids.shape[1]
    for node, ids, probs in zip(tree.q_nodes.tolist(), tree.q_token_ids, tree.q_probs, strict=True):
        expect_probs, expect_ids = expected_q(ctx, path_to(tree, node), params, sampling, next_logits).topk(k)
        keep = expect_probs > 0
        expect_probs, expect_ids = expect_probs[keep], expect_ids[keep]
        if not sampling.greedy:
            expect_probs = expect_probs / expect_probs.sum()
        got = ids[: len(expect_ids)]
        assert set(got.tolist()) == set(expect_ids.tolist()), f"node {node}"
        torch.testing.assert_close(
            probs[: len(expect_ids)].sort().values, expect_probs.sort().values, atol=1e-4, rtol=1e-3
        )


@pytest.mark.parametrize("shape", [CHAIN, TREE], ids=["chain", "tree"])
@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_q_rows_are_the_targets_processing_of_each_path(draft_dir, reference, shape, temperature):
    proposer = make(draft_dir, shape)
    ctxs = contexts(3, seed=4)[1:]
    plain = SamplingParams(temperature=temperature, seed=2 if temperature else None)
    cases = [settings(ctx, reference, temperature) for ctx in ctxs]
    # A plain sequence in the same batch stays plain.
    updates = [
        update(i, c, s, proposer=proposer) for i, (c, (_, s)) in enumerate(zip(ctxs, cases, strict=True))
    ]
    updates.append(update(9, ctxs[0], plain, proposer=proposer))
    trees = proposer.propose(updates)
    for tree, ctx, (params, sampling) in zip(trees, ctxs, cases, strict=False):
        assert tree.tokens.shape[0] > 3
        assert_processed_q(tree, ctx, params, sampling, reference)
    assert_processed_q(trees[-1], ctxs[0], RequestParams(temperature=temperature), plain, reference)


def test_path_tokens_are_counted_not_only_the_committed_output(draft_dir, reference):
    """Greedy chain under a strong frequency penalty: each draft is the argmax after the earlier
    drafts are penalised too (a drafter counting only the committed output repeats them)."""
    proposer = make(draft_dir, CHAIN)
    ctx = contexts(2, seed=5)[1]
    sampling = SamplingParams(frequency_penalty=2.0, presence_penalty=2.0, num_prompt=len(ctx) - 1)
    (tree,) = proposer.propose([update(0, ctx, sampling, proposer=proposer)])
    params = RequestParams(frequency_penalty=2.0, presence_penalty=2.0)
    drafts = []
    for _ in range(4):
        drafts.append(int(expected_q(ctx, drafts, params, sampling, reference).argmax()))
    assert tree.tokens[1:].tolist() == drafts


def test_the_fields_cross_the_wire_and_are_validated():
    from outrider.proto import FeatureSpec, InvalidDraftError, Limits, validate_update

    sampling = SamplingParams(
        temperature=0.7,
        logit_bias=((3, -1.5), (7, 2.0)),
        min_tokens=4,
        stop_ids=(0, 2),
        num_prompt=5,
        **PENALTIES,
    )
    message = SequenceUpdate.make_dummy(sampling=sampling).to_proto()
    assert (
        SamplingParams.from_proto(pb.SamplingParams.FromString(message.sampling.SerializeToString()))
        == sampling
    )
    assert SamplingParams.from_proto(pb.SamplingParams()).repetition_penalty == 1.0  # absent = off
    limits, spec = Limits(8, 16, 4, 4), FeatureSpec()
    bad = pb.SamplingParams(
        top_p=1.0, logit_bias_token_ids=[1, 2], logit_bias_values=[0.5]
    )  # one value short
    for wrong, field in [
        (SamplingParams.from_proto(bad), "logit_bias"),
        (SamplingParams(logit_bias=((99, 1.0),)), "logit_bias"),
        (SamplingParams(repetition_penalty=0.0), "repetition_penalty"),
        (SamplingParams(frequency_penalty=float("nan")), "frequency_penalty"),
        (SamplingParams(stop_ids=(40,)), "stop_ids"),
    ]:
        with pytest.raises(InvalidDraftError, match=field):
            validate_update(
                SequenceUpdate.make_dummy(sampling=wrong), vocab_size=32, limits=limits, features=spec
            )


def test_target_tells_the_drafter_its_prompt_length_and_stop_ids():
    params = RequestParams(min_tokens=3, logit_bias=((4, 1.0),), **PENALTIES)
    seq = Sequence(0, params, [5, 6, 7, 8], 3, None, params.sampling)
    seq.stop_ids = frozenset({2, 0})
    told = seq.draft_sampling
    assert (told.num_prompt, told.stop_ids, told.min_tokens, told.logit_bias) == (3, (0, 2), 3, ((4, 1.0),))
    assert (told.presence_penalty, told.frequency_penalty, told.repetition_penalty) == (0.8, 0.6, 1.4)
    plain = Sequence(1, RequestParams(), [5, 6], 1, None, RequestParams().sampling)
    assert plain.draft_sampling is plain.draft_params  # nothing added, nothing to process
    assert DraftProcessors.of([SequenceUpdate.make_dummy()], [plain]) is None
