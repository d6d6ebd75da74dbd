"""The draft server over real gRPC on 127.0.0.1: handshake, batching across streams, bad
updates, graceful shutdown, health, reflection, token check, message size limit.

The server runs in this process; the tests talk to it with the raw stubs so they see exactly
what goes over the wire.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import grpc
import pytest
import torch
from server_testlib import Stream

from outrider.draft_worker import build_proposer
from outrider.draft_worker.server import DRAFT_SERVICE, DraftIdentity, serve
from outrider.proto import (
    CandidateTree,
    HandshakeRequest,
    Limits,
    SamplingParams,
    SequenceUpdate,
    TreeBudget,
)
from outrider.proto import outrider_pb2 as pb
from outrider.proto import outrider_pb2_grpc as pb_grpc

VOCAB = 50
IDENTITY = DraftIdentity("ngram-test", VOCAB, "fingerprint")
BUDGET = TreeBudget(max_nodes=5, max_depth=4, top_k=1)
TOKEN = "s3cret"


class GatedProposer:
    """An ngram proposer that records each batch and can hold or slow drafting."""

    def __init__(self, delay_s: float = 0.0):
        self.inner = build_proposer(
            {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 2},
            vocab_size=VOCAB,
        )
        self.method, self.config, self.feature_spec = "ngram", self.inner.config, self.inner.feature_spec
        self.delay_s, self.gate = delay_s, threading.Event()
        self.gate.set()
        self.batches: list[list[int]] = []  # seq_ids (internal) of every propose call
        self.entered = threading.Event()

    def propose(self, updates: Sequence[SequenceUpdate]) -> list[CandidateTree]:
        self.entered.set()
        self.gate.wait(10)
        time.sleep(self.delay_s)
        self.batches.append([u.seq_id for u in updates if not u.finished])
        return self.inner.propose(updates)


def update(seq_id: int, tokens: list[int], round: int = 0, **kw) -> pb.SequenceUpdate:
    return SequenceUpdate(seq_id, round, torch.tensor(tokens), SamplingParams(), BUDGET, **kw).to_proto()


@pytest.fixture
def proposer() -> GatedProposer:
    return GatedProposer()


@pytest.fixture
def server(proposer):
    server = serve(proposer, IDENTITY, address="127.0.0.1:0")
    yield server
    server.stop(1)


@pytest.fixture
def channel(server):
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        yield channel


def handshake_request(**changes) -> pb.HandshakeRequest:
    fields = dict(
        target_model_id="target",
        vocab_size=VOCAB,
        vocab_fingerprint="fingerprint",
        target_num_layers=4,
        target_hidden_size=64,
        limits=Limits(64, 32, 8, 4),
    )
    return HandshakeRequest(**(fields | changes)).to_proto()


def test_handshake_reports_the_drafter(channel):
    reply = pb_grpc.DraftServiceStub(channel).Handshake(handshake_request(), timeout=5)
    assert (reply.method, reply.draft_model_id, reply.vocab_size) == ("ngram", "ngram-test", VOCAB)
    assert (reply.limits.max_nodes, reply.limits.max_depth, reply.limits.max_top_k) == (5, 4, 1)
    assert list(reply.features.layer_ids) == []


def test_handshake_refuses_a_mismatch_and_says_what_differs(channel):
    with pytest.raises(grpc.RpcError) as refused:
        pb_grpc.DraftServiceStub(channel).Handshake(
            handshake_request(vocab_size=VOCAB + 1, vocab_fingerprint="other", method="eagle3"), timeout=5
        )
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    details = refused.value.details()
    for field in ("vocab_size", "vocab_fingerprint", "method"):
        assert field in details


def test_batches_across_sequences_and_streams(server, proposer, channel):
    a, b = Stream(channel), Stream(channel)
    proposer.gate.clear()
    a.send(update(1, [1, 2, 3, 1, 2]))
    assert proposer.entered.wait(5)  # the loop now holds the first batch
    a.send(update(2, [7, 8, 7]))
    b.send(update(1, [4, 5, 6, 4, 5]))  # same seq_id, another target: another sequence
    time.sleep(0.2)
    proposer.gate.set()
    first, second = a.trees(2), b.trees(1)
    assert [len(batch) for batch in proposer.batches] == [1, 2]  # one propose for both streams
    assert list(first[1].tokens) == [2, 3, 1, 2, 3]
    assert list(first[2].tokens) == [7, 8, 7, 8, 7]
    assert list(second[1].tokens) == [5, 6, 4, 5, 6]
    a.requests.put(None)
    b.requests.put(None)
    assert a.ended.wait(5) and b.ended.wait(5) and a.error is None
    deadline = time.monotonic() + 5
    while proposer.inner.num_sequences and time.monotonic() < deadline:
        time.sleep(0.01)
    assert proposer.inner.num_sequences == 0  # closed streams free their sequences


def test_a_bad_update_gets_no_tree_until_reset(server, channel):
    stream = Stream(channel)
    stream.send(update(1, [1, 2, 1]), update(2, [3, VOCAB + 5]))  # 2 holds an out-of-vocab token
    assert list(stream.trees(1)) == [1]
    stream.send(update(1, [2], round=1), update(2, [3], round=1))  # 2 is out of sync: no tree
    assert list(stream.trees(1)) == [1]
    stream.send(update(2, [3, 4, 3], round=2, reset=True))
    tree = stream.trees(1)[2]
    assert (tree.round, list(tree.tokens)) == (2, [3, 4, 3, 4, 3])
    assert server.stats.invalid_updates == 1
    assert stream.received.empty()


def test_graceful_stop_answers_rounds_in_flight(proposer):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    proposer.delay_s = 0.5
    server = serve(proposer, IDENTITY, address="127.0.0.1:0")
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        health = health_pb2_grpc.HealthStub(channel)
        check = health_pb2.HealthCheckRequest(service=DRAFT_SERVICE)
        assert health.Check(check, timeout=5).status == health_pb2.HealthCheckResponse.SERVING
        stream = Stream(channel)
        stream.send(update(1, [1, 2, 1]))
        assert proposer.entered.wait(5)
        stopper = threading.Thread(target=server.stop, args=(5,))
        stopper.start()
        time.sleep(0.1)
        assert health.Check(check, timeout=5).status == health_pb2.HealthCheckResponse.NOT_SERVING
        assert list(stream.trees(1)) == [1]  # answered although the server was stopping
        assert stream.ended.wait(5) and stream.error is None  # then the stream ended cleanly
        stopper.join()


def test_reflection_lists_the_services(channel):
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    (reply,) = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
    names = {service.name for service in reply.list_services_response.service}
    assert {DRAFT_SERVICE, "grpc.health.v1.Health"} <= names


def test_token_is_checked_on_every_call_but_health(proposer):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    server = serve(proposer, IDENTITY, address="127.0.0.1:0", token=TOKEN)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = pb_grpc.DraftServiceStub(channel)
            for metadata in (None, (("authorization", "Bearer wrong"),)):
                with pytest.raises(grpc.RpcError) as refused:
                    stub.Handshake(handshake_request(), timeout=5, metadata=metadata)
                assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            stream = Stream(channel)
            stream.send(update(1, [1, 2, 1]))
            assert stream.ended.wait(5) and stream.error.code() == grpc.StatusCode.UNAUTHENTICATED
            good = (("authorization", f"Bearer {TOKEN}"),)
            assert stub.Handshake(handshake_request(), timeout=5, metadata=good).method == "ngram"
            stream = Stream(channel, metadata=good)
            stream.send(update(1, [1, 2, 1]))
            assert list(stream.trees(1)) == [1]
            request = health_pb2.HealthCheckRequest(service=DRAFT_SERVICE)
            assert health_pb2_grpc.HealthStub(channel).Check(request, timeout=5).status == 1
    finally:
        server.stop(1)


def test_messages_over_the_size_limit_are_refused(proposer):
    server = serve(proposer, IDENTITY, address="127.0.0.1:0", max_message_bytes=1 << 14)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stream = Stream(channel)
            stream.send(update(1, [1] * 20_000))
            assert stream.ended.wait(5)
            assert stream.error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        server.stop(1)
