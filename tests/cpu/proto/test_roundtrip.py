"""Every message survives dataclass -> protobuf -> bytes -> protobuf -> dataclass unchanged, and
what cannot be represented (bad feature bytes, ragged q rows, unknown modes) is refused."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from outrider.proto import (
    FEATURE_DTYPES,
    CandidateTree,
    DraftRequest,
    DraftResponse,
    DraftSampling,
    FeatureSpec,
    HandshakeRequest,
    HandshakeResponse,
    InvalidDraftError,
    Limits,
    SamplingParams,
    SequenceUpdate,
    TreeBudget,
    decode_tensor,
    encode_tensor,
)
from outrider.proto import outrider_pb2 as pb

UINT32 = st.integers(0, 2**32 - 1)
UINT64 = st.integers(0, 2**64 - 1)
FRACTION = st.floats(0.0, 1.0, allow_nan=False)


def through_wire(value: Any) -> Any:
    """to_proto, serialise, parse, from_proto: the path every message takes."""
    message = value.to_proto()
    parsed = type(message).FromString(message.SerializeToString())
    return type(value).from_proto(parsed)


def assert_same(a: Any, b: Any) -> None:
    """Field-wise equality where tensors must match in dtype, shape and every bit."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a.view(torch.uint8) if a.numel() else a, b.view(torch.uint8) if b.numel() else b)
    elif dataclasses.is_dataclass(a):
        assert type(a) is type(b)
        for field in dataclasses.fields(a):
            assert_same(getattr(a, field.name), getattr(b, field.name))
    elif isinstance(a, list | tuple):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    else:
        assert a == b and type(a) is type(b), (a, b)


sampling_params = st.builds(
    SamplingParams,
    temperature=st.floats(0.0, 10.0, allow_nan=False),
    top_k=st.integers(0, 2**31 - 1),
    top_p=FRACTION,
    min_p=FRACTION,
    seed=st.none() | UINT64,
)
budgets = st.builds(TreeBudget, max_nodes=UINT32, max_depth=UINT32, top_k=UINT32)
limits = st.builds(Limits, max_batch=UINT32, max_nodes=UINT32, max_depth=UINT32, max_top_k=UINT32)
feature_specs = st.builds(
    FeatureSpec,
    layer_ids=st.lists(UINT32, max_size=4).map(tuple),
    hidden_size=UINT32,
    projected=st.booleans(),
    dtype=st.sampled_from(sorted(FEATURE_DTYPES)),
)


@st.composite
def sequence_updates(draw: st.DrawFn) -> SequenceUpdate:
    num_tokens = draw(st.integers(0, 6))
    features = None
    if draw(st.booleans()):
        width = draw(st.integers(0, 5))
        dtype = draw(st.sampled_from(list(FEATURE_DTYPES.values())))
        features = torch.randn(num_tokens, width, generator=torch.Generator().manual_seed(num_tokens)).to(
            dtype
        )
    return SequenceUpdate(
        seq_id=draw(UINT64),
        round=draw(UINT64),
        new_tokens=torch.tensor(
            draw(st.lists(st.integers(0, 2**31 - 1), min_size=num_tokens, max_size=num_tokens)),
            dtype=torch.int64,
        ),
        sampling=draw(sampling_params),
        budget=draw(budgets),
        features=features,
        finished=draw(st.booleans()),
        reset=draw(st.booleans()),
    )


@st.composite
def candidate_trees(draw: st.DrawFn) -> CandidateTree:
    top_k = draw(st.integers(1, 4))
    return CandidateTree.make_dummy(
        draw(st.integers(1, 16)),
        vocab_size=draw(st.integers(top_k, 2**31 - 1)),
        top_k=top_k,
        sampling=draw(st.sampled_from(list(DraftSampling))),
        seq_id=draw(UINT64),
        round=draw(UINT64),
        seed=draw(st.integers(0, 1000)),
    )


@settings(max_examples=40, deadline=None)
@given(value=sampling_params | budgets | limits | feature_specs)
def test_small_messages_round_trip(value: Any) -> None:
    assert_same(value, through_wire(value))


@settings(max_examples=40, deadline=None)
@given(update=sequence_updates())
def test_sequence_update_round_trips(update: SequenceUpdate) -> None:
    assert_same(update, through_wire(update))


@settings(max_examples=40, deadline=None)
@given(tree=candidate_trees())
def test_candidate_tree_round_trips(tree: CandidateTree) -> None:
    assert_same(tree, through_wire(tree))


@settings(max_examples=10, deadline=None)
@given(updates=st.lists(sequence_updates(), max_size=3), trees=st.lists(candidate_trees(), max_size=3))
def test_batches_round_trip(updates: list[SequenceUpdate], trees: list[CandidateTree]) -> None:
    assert_same(DraftRequest(updates), through_wire(DraftRequest(updates)))
    assert_same(DraftResponse(trees), through_wire(DraftResponse(trees)))


@settings(max_examples=20, deadline=None)
@given(
    request=st.builds(
        HandshakeRequest,
        target_model_id=st.text(max_size=20),
        vocab_size=UINT64,
        vocab_fingerprint=st.text("0123456789abcdef", min_size=64, max_size=64),
        target_num_layers=UINT32,
        target_hidden_size=UINT32,
        limits=limits,
        method=st.text(max_size=10),
    ),
    response=st.builds(
        HandshakeResponse,
        draft_model_id=st.text(max_size=20),
        vocab_size=UINT64,
        vocab_fingerprint=st.text("0123456789abcdef", min_size=64, max_size=64),
        method=st.text(max_size=10),
        limits=limits,
        features=feature_specs,
        target_model_id=st.text(max_size=20),
    ),
)
def test_handshake_round_trips(request: HandshakeRequest, response: HandshakeResponse) -> None:
    assert_same(request, through_wire(request))
    assert_same(response, through_wire(response))


def test_unseeded_sampling_stays_unseeded() -> None:
    assert through_wire(SamplingParams(temperature=0.7)).seed is None
    assert through_wire(SamplingParams(temperature=0.7, seed=0)).seed == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_feature_tensor_bytes_round_trip(dtype: torch.dtype) -> None:
    values = torch.randn(3, 5, generator=torch.Generator().manual_seed(0)).to(dtype)
    message = pb.Tensor.FromString(encode_tensor(values).SerializeToString())
    assert len(message.data) == values.numel() * values.element_size()
    decoded = decode_tensor(message)
    assert decoded.dtype == dtype and decoded.shape == values.shape
    assert torch.equal(decoded.view(torch.int8), values.view(torch.int8))


def test_feature_tensor_of_a_non_contiguous_view_round_trips() -> None:
    values = torch.arange(12, dtype=torch.float32).reshape(3, 4).t()
    assert torch.equal(decode_tensor(encode_tensor(values)), values)


def test_empty_feature_tensor_keeps_its_shape() -> None:
    assert decode_tensor(encode_tensor(torch.empty(0, 7, dtype=torch.bfloat16))).shape == (0, 7)


def test_rejects_feature_bytes_of_the_wrong_length() -> None:
    message = encode_tensor(torch.zeros(2, 3, dtype=torch.float16))
    message.data = message.data[:-1]
    with pytest.raises(
        InvalidDraftError, match=r"features.data has 11 bytes, but shape \[2, 3\] of float16 needs"
    ):
        decode_tensor(message, "features")


@pytest.mark.parametrize("dtype", ["float64", "int8", ""])
def test_rejects_feature_dtype_outside_the_allowed_set(dtype: str) -> None:
    message = pb.Tensor(dtype=dtype, shape=[1], data=b"\0" * 8)
    with pytest.raises(InvalidDraftError, match=rf"features.dtype = '{dtype}' is not one of"):
        decode_tensor(message, "features")


def test_rejects_negative_feature_shape() -> None:
    with pytest.raises(InvalidDraftError, match=r"features.shape\[1\] = -2 is negative"):
        decode_tensor(pb.Tensor(dtype="float32", shape=[2, -2], data=b"\0" * 16), "features")


def test_update_with_bad_feature_bytes_names_the_update() -> None:
    message = SequenceUpdate.make_dummy(seq_id=5, num_new_tokens=2, feature_width=4).to_proto()
    message.features.shape[1] = 5
    with pytest.raises(InvalidDraftError, match=r"updates\[0\]\(seq_id=5\).features.data has 16 bytes"):
        DraftRequest.from_proto(pb.DraftRequest(updates=[message]))


@pytest.mark.parametrize("sampling", [pb.DRAFT_SAMPLING_UNSPECIFIED, 7])
def test_tree_from_proto_rejects_unknown_sampling_mode(sampling: int) -> None:
    message = CandidateTree.make_dummy(3).to_proto()
    message.sampling = sampling
    with pytest.raises(InvalidDraftError, match="is not a draft sampling mode"):
        CandidateTree.from_proto(message)


def test_tree_from_proto_rejects_ragged_q_rows() -> None:
    message = CandidateTree.make_dummy(5, top_k=2, seq_id=4, round=9).to_proto()
    del message.q_probs[-1]
    with pytest.raises(
        InvalidDraftError, match=r"tree seq_id=4 round=9: q_probs has \d+ values, but len\(q_nodes\)"
    ):
        CandidateTree.from_proto(message)


def test_chain_encoding_is_compact() -> None:
    # A 60-node chain costs at most 3 bytes per token id (< 2^21) and 1 per parent (zigzag for the -1).
    chain = CandidateTree.make_dummy(60, vocab_size=32000, top_k=1, sampling=DraftSampling.DETERMINISTIC)
    chain.q_nodes = chain.q_nodes[:0]
    chain.q_token_ids, chain.q_probs = chain.q_token_ids[:0], chain.q_probs[:0]
    assert chain.to_proto().ByteSize() <= 60 * 4 + 20
