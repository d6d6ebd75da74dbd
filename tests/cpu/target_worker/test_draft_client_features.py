"""Target features over the wire: the client sends them in the handshake's dtype as raw bytes,
remembers them with the context, and re-sends the whole [context, width] block on a re-sync.
`projected` flows from the drafter's handshake into the client's feature spec (H per token)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from draft_worker import build_proposer
from draft_worker.server import DraftIdentity, serve
from proto import FeatureSpec, HandshakeRequest, Limits, SamplingParams, SequenceUpdate, TreeBudget
from target_worker.draft_client import DraftClientConfig, RemoteDraftSource

VOCAB, HIDDEN = 50, 16
BUDGET = TreeBudget(4, 3, 1)


class FeatureRecorder:
    """An ngram drafter that claims EAGLE-style features and records what it receives."""

    def __init__(self, spec: FeatureSpec):
        self.inner = build_proposer({"method": "ngram", "num_speculative_tokens": 3}, vocab_size=VOCAB)
        self.method, self.config, self.feature_spec = "eagle3", self.inner.config, spec
        self.received: list[SequenceUpdate] = []
        self.lock = threading.Lock()

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
    width = spec.width  # H when projected, 3H otherwise
    recorder = FeatureRecorder(spec)
    server = serve(recorder, DraftIdentity("eagle", VOCAB, "fp"), address="127.0.0.1:0")
    source = _source(server.port)
    try:
        assert source.wait_ready(10) and source.feature_spec == spec
        first = torch.randn(3, width)  # float32 from the engine; bf16 on the wire
        source.submit([_update(1, [1, 2, 3], first, reset=True)])
        assert 1 in source.collect([1], 5)
        second = torch.randn(1, width)
        source.submit([_update(2, [4], second)])
        assert 1 in source.collect([1], 5)
        sent = recorder.received
        assert [u.features.dtype for u in sent] == [torch.bfloat16] * 2
        assert torch.equal(sent[1].features, second.to(torch.bfloat16)) and not sent[1].reset

        port = server.port  # the worker restarts: the next round must carry everything again
        server.stop(1)
        recorder = FeatureRecorder(spec)
        server = serve(recorder, DraftIdentity("eagle", VOCAB, "fp"), address=f"127.0.0.1:{port}")
        deadline = time.monotonic() + 10
        while not source.endpoints[0].healthy:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        third = torch.randn(1, width)
        source.submit([_update(3, [5], third)])
        assert 1 in source.collect([1], 5)
        (resync,) = recorder.received
        assert resync.reset and resync.new_tokens.tolist() == [1, 2, 3, 4, 5]
        assert torch.equal(resync.features, torch.cat([first, second, third]).to(torch.bfloat16))
        assert source.counters.resyncs == 1 and source.counters.reconnects == 1
    finally:
        source.close()
        server.stop(1)
