"""Target features over the wire: the client sends them in the handshake's dtype as raw bytes,
remembers them with the context, and re-sends the whole [context, width] block on a re-sync.
With a `projected` spec the client fetches the drafter's fc (FeatureProjection), checks its
sha256, and sends fc(raw) — H values per token — while keeping the raw rows for re-syncs."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from outrider.draft_worker import build_proposer
from outrider.draft_worker.server import DraftIdentity, serve
from outrider.proto import FeatureSpec, HandshakeRequest, Limits, SamplingParams, SequenceUpdate, TreeBudget
from outrider.target_worker.draft_client import DraftClientConfig, RemoteDraftSource

VOCAB, HIDDEN = 50, 16
BUDGET = TreeBudget(4, 3, 1)


class FeatureRecorder:
    """An ngram drafter that claims EAGLE-style features and records what it receives."""

    def __init__(self, spec: FeatureSpec, projection: torch.Tensor | None = None):
        self.projection = projection
        self.inner = build_proposer({"method": "ngram", "num_speculative_tokens": 3}, vocab_size=VOCAB)
        self.method, self.config, self.feature_spec = "eagle3", self.inner.config, spec
        self.received: list[SequenceUpdate] = []
        self.lock = threading.Lock()

    def feature_projection(self):
        return self.projection

    def propose(self, updates):
        with self.lock:
            self.received.extend(u for u in updates if not u.finished)
        return self.inner.propose([SequenceUpdate(**{**vars(u), "features": None}) for u in updates])


def _source(port: int) -> RemoteDraftSource:
    handshake = HandshakeRequest("target", VOCAB, "fp", 8, HIDDEN, Limits(64, 16, 8, 4))
    return RemoteDraftSource([f"127.0.0.1:{port}"], handshake, DraftClientConfig(backoff_initial_s=0.02))


def _update(round: int, tokens: list[int], features: torch.Tensor, **kw) -> SequenceUpdate:
    return SequenceUpdate(1, round, torch.tensor(tokens), SamplingParams(), BUDGET, features=features, **kw)


@pytest.mark.parametrize("projected", [False, True])
def test_features_travel_in_the_agreed_dtype_and_resync_whole(projected):
    spec = FeatureSpec(layer_ids=(1, 4, 6), hidden_size=HIDDEN, projected=projected, dtype="bfloat16")
    width = 3 * HIDDEN  # the engine always hands over the raw concatenation
    fc = torch.randn(HIDDEN, width, generator=torch.Generator().manual_seed(0)) if projected else None

    def wire(raw: torch.Tensor) -> torch.Tensor:  # what the drafter must receive
        return (raw.to(torch.bfloat16).float() @ fc.T if projected else raw).to(torch.bfloat16)

    recorder = FeatureRecorder(spec, fc)
    server = serve(recorder, DraftIdentity("eagle", VOCAB, "fp"), address="127.0.0.1:0")
    source = _source(server.port)
    try:
        assert source.wait_ready(10) and source.feature_spec == spec
        assert (source.feature_projection() is not None) == projected
        first = torch.randn(3, width).to(torch.bfloat16)  # the engine's capture, in the agreed dtype
        source.submit([_update(1, [1, 2, 3], first, reset=True)])
        assert 1 in source.collect([1], 5)
        second = torch.randn(1, width).to(torch.bfloat16)
        source.submit([_update(2, [4], second)])
        assert 1 in source.collect([1], 5)
        sent = recorder.received
        assert [u.features.dtype for u in sent] == [torch.bfloat16] * 2
        assert [u.features.shape[1] for u in sent] == [spec.width] * 2  # H when projected
        assert torch.equal(sent[1].features, wire(second)) and not sent[1].reset

        port = server.port  # the worker restarts: the next round must carry everything again
        server.stop(1)
        recorder = FeatureRecorder(spec, fc)
        server = serve(recorder, DraftIdentity("eagle", VOCAB, "fp"), address=f"127.0.0.1:{port}")
        deadline = time.monotonic() + 10
        while not source.endpoints[0].healthy:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        third = torch.randn(1, width).to(torch.bfloat16)
        source.submit([_update(3, [5], third)])
        assert 1 in source.collect([1], 5)
        (resync,) = recorder.received
        assert resync.reset and resync.new_tokens.tolist() == [1, 2, 3, 4, 5]
        assert torch.equal(resync.features, wire(torch.cat([first, second, third])))
        assert source.counters.resyncs == 1 and source.counters.reconnects == 1
    finally:
        source.close()
        server.stop(1)


def test_a_worker_with_another_projection_is_refused():
    spec = FeatureSpec(layer_ids=(1, 4, 6), hidden_size=HIDDEN, projected=True, dtype="bfloat16")
    fc = torch.randn(HIDDEN, 3 * HIDDEN)
    first = serve(FeatureRecorder(spec, fc), DraftIdentity("eagle", VOCAB, "fp"), address="127.0.0.1:0")
    other = serve(FeatureRecorder(spec, fc + 1), DraftIdentity("eagle", VOCAB, "fp"), address="127.0.0.1:0")
    source = _source(first.port)
    try:
        assert source.wait_ready(10) and torch.equal(source.feature_projection(), fc)
        # A worker publishing another fc would have the engine send it the wrong H values.
        source.set_endpoints([f"127.0.0.1:{first.port}", f"127.0.0.1:{other.port}"])
        deadline = time.monotonic() + 10
        while not source.endpoints[1].refused:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert "projection" in str(source.endpoints[1].last_error)
        assert source.endpoints[0].healthy and torch.equal(source.feature_projection(), fc)
    finally:
        source.close()
        first.stop(1)
        other.stop(1)


def test_join_projection_refuses_blocks_that_do_not_match_the_handshake():
    from outrider.proto import InvalidDraftError, join_projection, projection_chunks, projection_sha256

    fc = torch.randn(40, 24)
    chunks = projection_chunks(fc, max_chunk_bytes=24 * 4 * 7)  # 7 rows a block
    assert len(chunks) == 6 and torch.equal(join_projection(chunks, projection_sha256(fc)), fc)
    with pytest.raises(InvalidDraftError, match="sha256"):
        join_projection(chunks[:-1], projection_sha256(fc))
