"""A hostile target against the draft server, over real gRPC on 127.0.0.1.

Generated Draft streams (hypothesis) send what a broken or hostile target might: wrong and
huge rounds and seq_ids, new_tokens out of the vocabulary, empty or huge, feature tensors of
the wrong shape, dtype or byte count, sampling and budgets out of range, reset storms, and
thousands of sequences; then they half-close or drop the stream. Meanwhile a good target
holds its own stream on the same server. For every case:

- the server survives and the good target's stream keeps drafting (a tree for each round);
- a hostile stream ends with OK or with a status that names its fault (INVALID_ARGUMENT,
  RESOURCE_EXHAUSTED), never INTERNAL or UNKNOWN, and never hangs;
- what the hostile stream held is freed once it ends (the proposer's sequences return to the
  good target's), and the process's memory stays bounded.
"""

from __future__ import annotations

import resource
import threading
import time

import grpc
import pytest
import torch
from fuzz_testlib import Outcomes, fuzz
from hypothesis import given
from hypothesis import strategies as st
from server_testlib import Stream as Target

from outrider.draft_worker import build_proposer
from outrider.draft_worker.server import DraftIdentity, StreamLimits, serve
from outrider.proto import (
    CandidateTree,
    DraftSampling,
    FeatureSpec,
    SamplingParams,
    SequenceUpdate,
    TreeBudget,
)
from outrider.proto import outrider_pb2 as pb
from outrider.proto import outrider_pb2_grpc as pb_grpc

VOCAB = 64
WIDTH = 4  # feature values per token the drafter asks for
SPEC = FeatureSpec(layer_ids=(1,), hidden_size=WIDTH, dtype="float32")
LIMITS = StreamLimits(
    max_sequences=200, max_tokens=50_000, max_invalid_in_row=16, max_pending=2, max_outbox=8
)
BUDGET = TreeBudget(max_nodes=5, max_depth=4, top_k=1)
UINT64, UINT32, INT32 = 2**64 - 1, 2**32 - 1, 2**31 - 1
FAULT_CODES = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED}


class FeatureNgram:
    """The ngram proposer, asking for features (which it ignores) so features are checked."""

    def __init__(self):
        self.inner = build_proposer(
            {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 2},
            vocab_size=VOCAB,
        )
        self.method, self.config, self.feature_spec = "ngram", self.inner.config, SPEC

    @property
    def num_sequences(self) -> int:
        return self.inner.num_sequences

    def propose(self, updates):
        return self.inner.propose(updates)


def update(seq_id: int, tokens: list[int], round: int = 0, **kw) -> pb.SequenceUpdate:
    features = torch.randn(len(tokens), WIDTH)
    return SequenceUpdate(
        seq_id, round, torch.tensor(tokens), SamplingParams(), BUDGET, features=features, **kw
    ).to_proto()


class GoodTarget:
    """A well-behaved target: one sequence, one round at a time, each answered within a deadline."""

    def __init__(self, channel: grpc.Channel):
        self.target, self.round, self.seconds = Target(channel), 0, []
        self.target.send(update(1, [5, 6, 7, 5, 6], reset=True))
        self._expect()

    def step(self, timeout_s: float = 10.0) -> None:
        self.round += 1
        self.target.send(update(1, [7], round=self.round))
        self._expect(timeout_s)

    def _expect(self, timeout_s: float = 10.0) -> None:
        started = time.monotonic()
        while True:
            tree = self.target.received.get(timeout=timeout_s)  # queue.Empty: the good target starved
            if tree.round == self.round:
                break
        self.seconds.append(time.monotonic() - started)
        assert not self.target.ended.is_set(), self.target.error


@pytest.fixture(scope="module")
def proposer() -> FeatureNgram:
    return FeatureNgram()


@pytest.fixture(scope="module")
def server(proposer):
    server = serve(
        proposer,
        DraftIdentity("ngram-fuzz", VOCAB, "fingerprint"),
        address="127.0.0.1:0",
        stream_limits=LIMITS,
    )
    yield server
    server.stop(1)


@pytest.fixture(scope="module")
def channel(server):
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        yield channel


@pytest.fixture(scope="module")
def good(channel) -> GoodTarget:
    return GoodTarget(channel)


# ------------------------------------------------------------------------------ strategies

TOKENS = st.one_of(
    st.lists(st.integers(0, VOCAB - 1), max_size=12),
    st.lists(st.one_of(st.integers(-(2**31), INT32), st.sampled_from([-1, VOCAB, INT32])), max_size=6),
    st.builds(lambda n: [3] * n, st.sampled_from([4_000, 60_000])),
)


@st.composite
def features(draw, num_tokens: int) -> pb.Tensor | None:
    kind = draw(st.sampled_from(["right", "right", "none", "shape", "dtype", "bytes", "huge", "dims"]))
    if kind == "none":
        return None
    shape, dtype = [num_tokens, WIDTH], "float32"
    if kind == "shape":
        shape = [num_tokens + draw(st.integers(-1, 2)), WIDTH + draw(st.integers(-1, 2))]
    elif kind == "dtype":
        dtype = draw(st.sampled_from(["bfloat16", "float16", "int64", "", "float32\x00", "ñ"]))
    elif kind == "huge":
        shape = [2**62, 2**62]
    elif kind == "dims":
        shape = draw(st.lists(st.integers(-3, 5), max_size=70))
    size = 1
    for n in shape:
        size *= max(n, 0)
    nbytes = 4 * size if kind in ("right", "shape", "dims") and size < 1 << 20 else draw(st.integers(0, 64))
    if kind == "bytes":
        nbytes = 4 * num_tokens * WIDTH + draw(st.sampled_from([-4, -1, 1, 3]))
    return pb.Tensor(dtype=dtype, shape=shape, data=bytes(max(nbytes, 0)))


@st.composite
def hostile_update(draw) -> pb.SequenceUpdate:
    tokens = draw(TOKENS)
    message = pb.SequenceUpdate(
        seq_id=draw(st.one_of(st.integers(0, 8), st.just(UINT64))),
        round=draw(st.one_of(st.integers(0, 3), st.integers(0, UINT64))),
        new_tokens=tokens,
        sampling=pb.SamplingParams(
            temperature=draw(st.one_of(st.just(0.0), st.floats(allow_nan=True, allow_infinity=True))),
            top_k=draw(st.one_of(st.just(0), st.integers(-(2**31), INT32))),
            top_p=draw(st.one_of(st.just(1.0), st.floats())),
            min_p=draw(st.one_of(st.just(0.0), st.floats())),
            seed=draw(st.one_of(st.none(), st.integers(0, UINT64))),
        ),
        budget=pb.TreeBudget(
            max_nodes=draw(st.one_of(st.just(5), st.integers(0, UINT32))),
            max_depth=draw(st.one_of(st.just(4), st.integers(0, UINT32))),
            top_k=draw(st.one_of(st.just(1), st.integers(0, UINT32))),
            q_width=draw(st.one_of(st.just(0), st.integers(0, UINT32))),
        ),
        finished=draw(st.booleans()),
        reset=draw(st.booleans()),
        answered=draw(st.booleans()),
    )
    tensor = draw(features(len(tokens)))
    if tensor is not None:
        message.features.CopyFrom(tensor)
    return message


def many_sequences(count: int) -> pb.DraftRequest:
    return pb.DraftRequest(updates=[update(i, [1, 2, 1], reset=True) for i in range(count)])


def reset_storm(count: int) -> list[pb.DraftRequest]:
    return [
        pb.DraftRequest(updates=[update(7, [1, 2, 3, 1] * 50, round=r, reset=True)]) for r in range(count)
    ]


REQUESTS = st.one_of(
    st.lists(hostile_update(), max_size=5).map(lambda u: [pb.DraftRequest(updates=u)]),
    st.sampled_from([150, 250, 3_000]).map(lambda n: [many_sequences(n)]),
    st.sampled_from([20, 300]).map(reset_storm),
    st.just([pb.DraftRequest()]),
    hostile_update().map(lambda u: [pb.DraftRequest(updates=[u])] * 20),  # the same, round after round
)
SESSION = st.tuples(
    st.lists(REQUESTS, min_size=1, max_size=4).map(lambda batches: [r for b in batches for r in b]),
    st.sampled_from(["half-close", "half-close", "drop", "drop-at-once"]),
)


# ------------------------------------------------------------------------------ the fuzz test


def rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # peak, KiB on Linux


@pytest.fixture(scope="module")
def outcomes():
    recorded = Outcomes("grpc draft server (hostile target)")
    yield recorded
    recorded.save()


def wait_until(condition, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


@fuzz(120)
@given(session=SESSION)
def test_a_hostile_target_cannot_hurt_the_server_or_other_targets(
    server, channel, proposer, good, outcomes, session
):
    requests, ending = session
    started, hostile = time.monotonic(), Target(channel)
    if ending == "drop-at-once":
        for request in requests:
            hostile.requests.put(request)
        hostile.call.cancel()
    else:
        for request in requests:
            hostile.requests.put(request)
        good.step()  # drafting for the good target continues while the hostile stream is busy
        if ending == "drop":
            hostile.call.cancel()
        else:
            hostile.requests.put(None)
    assert hostile.ended.wait(20), "the hostile stream neither ended nor was ended"
    code = hostile.error.code() if hostile.error is not None else grpc.StatusCode.OK
    if code in FAULT_CODES:
        details = hostile.error.details()
        assert details and "\n" not in details and "Traceback" not in details, details
        outcome = f"stream refused: {code.name}"
    elif code == grpc.StatusCode.CANCELLED:
        assert ending != "half-close", hostile.error
        outcome = "stream dropped by the target"
    else:
        assert code == grpc.StatusCode.OK, (code, hostile.error and hostile.error.details())
        outcome = "stream served to its end"
    good.step()
    # What the hostile stream held is freed: only the good target's sequence remains.
    assert wait_until(lambda: proposer.num_sequences == 1), proposer.num_sequences
    assert rss_mb() < 2048, rss_mb()
    outcomes.add(outcome, started)


# ------------------------------------------------------------------------------ named cases


def test_the_good_target_keeps_drafting_through_a_flood(server, channel, proposer, good):
    """Hostile streams flood the server (thousands of sequences, reset storms, garbage) while a
    good target drafts round after round: every one of its rounds is answered in time."""
    stop = threading.Event()
    refused: list[grpc.StatusCode] = []

    def flood() -> None:
        while not stop.is_set():
            hostile = Target(channel)
            hostile.send(
                *[update(i, [1, 2, 1, 2] * 10, reset=True) for i in range(LIMITS.max_sequences + 50)]
            )
            for request in reset_storm(50):
                hostile.requests.put(request)
            hostile.send(update(3, [VOCAB + 1]), update(4, [1], round=2**63))
            assert hostile.ended.wait(20)
            refused.append(hostile.error.code() if hostile.error else grpc.StatusCode.OK)

    floods = [threading.Thread(target=flood, daemon=True) for _ in range(2)]
    for thread in floods:
        thread.start()
    good.seconds.clear()
    for _ in range(30):
        good.step(timeout_s=5)
    stop.set()
    for thread in floods:
        thread.join(30)
    assert refused and all(code == grpc.StatusCode.RESOURCE_EXHAUSTED for code in refused), refused
    assert max(good.seconds) < 5, good.seconds
    assert wait_until(lambda: proposer.num_sequences == 1), proposer.num_sequences


def test_too_many_sequences_is_refused_with_a_status_that_says_why(channel, good):
    hostile = Target(channel)
    updates = many_sequences(240).updates
    hostile.send(*updates[:120])
    hostile.send(*updates[120:])  # 120 more: past max_sequences = 200
    assert hostile.ended.wait(10)
    assert hostile.error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "at most 200 per stream" in hostile.error.details()
    good.step()


def test_one_request_past_the_limits_is_refused_before_decoding(channel, good):
    for request, words in (
        (many_sequences(LIMITS.max_sequences + 1), "at most 200 sequences per stream"),
        (pb.DraftRequest(updates=[update(1, [1] * (LIMITS.max_tokens + 1))]), "at most 50000 context tokens"),
    ):
        hostile = Target(channel)
        hostile.requests.put(request)
        assert hostile.ended.wait(10)
        assert hostile.error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert words in hostile.error.details(), hostile.error.details()
    good.step()


def test_nothing_but_invalid_updates_ends_the_stream_naming_the_fault(channel, server, good):
    hostile = Target(channel)
    for i in range(LIMITS.max_invalid_in_row):
        hostile.send(update(i, [VOCAB + 3]))
    assert hostile.ended.wait(10)
    assert hostile.error.code() == grpc.StatusCode.INVALID_ARGUMENT
    details = hostile.error.details()
    assert f"{LIMITS.max_invalid_in_row} invalid updates in a row" in details
    assert "new_tokens[0] = 67 is outside the vocabulary" in details, details
    good.step()


class WideTrees(FeatureNgram):
    """Answers every update at once with a ~160 KB tree: a reader that never reads fills up fast."""

    def propose(self, updates):
        wide = 20_000
        return [
            CandidateTree(
                u.seq_id,
                u.round,
                u.new_tokens[-1:],
                torch.tensor([-1]),
                torch.tensor([0]),
                torch.zeros(1, wide, dtype=torch.int64),
                torch.full((1, wide), 1 / wide),
                DraftSampling.WITH_REPLACEMENT,
            )
            for u in updates
            if not u.finished
        ]


def test_a_target_that_never_reads_cannot_grow_the_servers_memory():
    """Requests keep coming and no answer is ever read: the stream's reader waits once its
    answers back up, so the server holds a few of them, not all (~3 GB here)."""
    server = serve(
        WideTrees(), DraftIdentity("wide", VOCAB, "f"), address="127.0.0.1:0", stream_limits=LIMITS
    )
    try:
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            request = pb.DraftRequest(updates=[update(i, [1, 2, 1], reset=True) for i in range(10)])
            before = rss_mb()
            call = pb_grpc.DraftServiceStub(channel).Draft(iter([request] * 2000))
            # `call` is never iterated: no answer is ever read.
            time.sleep(3.0)
            sent = server.stats.trees_sent
            time.sleep(1.0)
            stalled = server.stats.trees_sent - sent
            grown = rss_mb() - before
            call.cancel()
        assert stalled == 0, stalled  # the reader waits: nothing more is drafted
        assert sent < 2000 * 10 // 4, sent  # most requests were never taken in
        assert grown < 500, f"{grown:.0f} MB"
    finally:
        server.stop(1)
