"""The gRPC draft client end to end through the step engine: greedy output through a remote
draft server equals speculation off, for every registered proposer, with several concurrent
sequences; and it stays equal when the server is late, answers garbage, lies at the
handshake, or fails (sequences stick to one of several servers and move when it fails).
"""

from __future__ import annotations

import importlib
import pkgutil
import time

import pytest
from draft_client_testlib import (
    DelayedProposer,
    ScriptedDrafter,
    StopAfter,
    client,
    encode_prompts,
    garbage_trees,
    generate,
    honest_handshake,
    load_runner,
    start_scripted,
    start_server,
    target_handshake,
)

from outrider import draft_worker
from outrider.draft_worker.server_cli import build_server_proposer
from outrider.proto import HandshakeMismatchError
from outrider.target_worker.draft_client import DraftClientConfig, RemoteDraftSource

# Import every draft_worker module so each proposer that exists registers, later ones included.
for module in pkgutil.iter_modules(draft_worker.__path__):
    importlib.import_module(f"outrider.draft_worker.{module.name}")
METHODS = [m for m in draft_worker.known_methods() if not m.startswith("test_")]


@pytest.fixture(scope="module")
def runner(tiny_family):
    return load_runner(tiny_family.target_dir)


@pytest.fixture(scope="module")
def prompts(tiny_family):
    return encode_prompts(tiny_family.tokenizer_dir)


@pytest.fixture(scope="module")
def plain(runner, prompts):
    return generate(runner, prompts)[0]


def proposer_for(family, method: str):
    """The method's demo drafter, as `outrider draft-server --demo` picks it: the family's draft
    LM, a trained head (eagle3, medusa, mtp, peagle: built once per session and cached), or no
    model at all (ngram, suffix)."""
    from outrider.draft_worker.training.demo_heads import demo_head_dir, head_methods

    model_dir = family.draft_dir
    if method != "draft_model" and method in head_methods():
        model_dir = demo_head_dir(family, method, progress=False, log=lambda _: None)
    return build_server_proposer(method, {"num_speculative_tokens": 4}, model_dir, family.tokenizer_dir)


@pytest.mark.parametrize("method", METHODS)
def test_greedy_through_a_remote_drafter_equals_plain(tiny_family, runner, prompts, plain, method):
    proposer = proposer_for(tiny_family, method)
    server = start_server(tiny_family, method, proposer=proposer)
    # A drafter that needs target features (the final hidden state for mtp and medusa, fused
    # layers for eagle3/peagle) gets them: the engine captures what the client expects.
    source = client(
        tiny_family, [f"127.0.0.1:{server.port}"], round_deadline_s=5.0, features=proposer.feature_spec
    )
    try:
        assert source.wait_ready(10)
        outputs, stats = generate(runner, prompts, source)
        assert outputs == plain
        assert stats.spec.num_draft_tokens > 0, stats.spec  # it drafted (features arrived, if needed)
        if proposer.feature_spec.needs_features:  # trained heads: 51-65 of 98-154 accepted (measured)
            assert stats.spec.num_accepted_tokens > 0, stats.spec
        counters = source.counters
        assert counters.trees_received == stats.num_trees > 0
        assert counters.trees_invalid == counters.trees_missing == stats.num_invalid_trees == 0
        assert server.stats.batches < counters.trees_received  # sequences were drafted together
    finally:
        source.close()
        server.stop(1)


def test_late_server_costs_speculation_not_correctness(tiny_family, runner, prompts, plain):
    slow = DelayedProposer(proposer_for(tiny_family, "ngram"), delay_s=0.05)
    server = start_server(tiny_family, proposer=slow)
    source = client(tiny_family, [f"127.0.0.1:{server.port}"])
    try:
        assert source.wait_ready(10)
        outputs, stats = generate(runner, prompts, source, timeout_s=0.005)
        assert outputs == plain
        assert source.counters.trees_missing == stats.num_missing_trees > 0
        assert source.counters.trees_invalid == 0
    finally:
        source.close()
        server.stop(1)
    assert source.counters.trees_late > 0


def test_garbage_trees_are_dropped_and_counted(tiny_family, runner, prompts, plain):
    request = target_handshake(tiny_family)
    drafter = ScriptedDrafter(honest_handshake(request), lambda u: garbage_trees(u, request.vocab_size))
    server, port = start_scripted(drafter)
    source = client(tiny_family, [f"127.0.0.1:{port}"])
    try:
        assert source.wait_ready(10)
        outputs, stats = generate(runner, prompts, source)
        assert outputs == plain
        assert stats.num_trees == source.counters.trees_received == 0
        assert source.counters.trees_invalid == stats.num_missing_trees > 0  # each round's tree was dropped
    finally:
        source.close()
        server.stop(None)


def test_a_lying_handshake_is_refused_clearly(tiny_family, runner, prompts, plain):
    request = target_handshake(tiny_family)
    lie = honest_handshake(request, vocab_size=request.vocab_size + 1, vocab_fingerprint="0" * 64)
    server, port = start_scripted(ScriptedDrafter(lie, lambda u: []))
    source = client(tiny_family, [f"127.0.0.1:{port}"])
    try:
        with pytest.raises(HandshakeMismatchError) as refused:
            source.wait_ready(10)
        message = str(refused.value)
        assert "vocab_size" in message and "vocab_fingerprint" in message and "tokenizers differ" in message
        assert generate(runner, prompts, source)[0] == plain  # unspeculated
        assert source.counters.handshake_refusals >= 1 and source.counters.trees_received == 0
    finally:
        source.close()
        server.stop(None)


def test_the_server_refuses_a_mismatched_target_too(tiny_family):
    server = start_server(tiny_family)
    wrong = target_handshake(tiny_family, vocab_fingerprint="f" * 64)
    source = RemoteDraftSource([f"127.0.0.1:{server.port}"], wrong, DraftClientConfig(connect_timeout_s=1.0))
    try:
        with pytest.raises(HandshakeMismatchError, match="vocab_fingerprint"):
            source.wait_ready(10)
    finally:
        source.close()
        server.stop(1)


def test_sticky_routing_and_moving_off_a_failed_worker(tiny_family, runner, prompts, plain):
    servers = [start_server(tiny_family) for _ in range(2)]
    source = client(tiny_family, [f"127.0.0.1:{s.port}" for s in servers], round_deadline_s=5.0)
    try:
        wait_all_healthy(source)
        many = prompts * 4  # 16 sequences over 2 workers
        assert generate(runner, many, source, max_tokens=8)[0] == [p[:8] for p in plain * 4]
        assert all(s.stats.trees_sent > 0 for s in servers)  # the hash spread the sequences
        assert source.counters.resyncs == 0  # and each stayed on its worker
        received = source.counters.trees_received
        outputs, stats = generate(runner, many, StopAfter(source, 3, lambda: servers[0].stop(1)))
        assert outputs == plain * 4
        assert source.counters.resyncs > 0  # the moved sequences were re-sent whole
        assert source.counters.trees_invalid == stats.num_invalid_trees == 0
        assert (
            source.counters.trees_received - received == stats.num_trees > stats.num_rounds
        )  # still speculating
    finally:
        source.close()
        servers[1].stop(1)


def wait_all_healthy(source: RemoteDraftSource) -> None:
    deadline = time.monotonic() + 10
    while not all(e.healthy for e in source.endpoints):
        assert time.monotonic() < deadline, [e.last_error for e in source.endpoints]
        time.sleep(0.01)


def test_set_endpoints_follows_a_scaling_draft_pool(tiny_family, runner, prompts, plain):
    """Autoscaling adds and removes draft replicas: the client connects to new ones and moves
    the sequences of a removed one (whole context re-sent), with output unchanged."""
    first, second = start_server(tiny_family), start_server(tiny_family)
    source = client(tiny_family, [f"127.0.0.1:{first.port}"], round_deadline_s=5.0)
    many = prompts * 4
    try:
        wait_all_healthy(source)
        source.set_endpoints([f"127.0.0.1:{first.port}", f"127.0.0.1:{second.port}"])  # scale up
        wait_all_healthy(source)
        assert generate(runner, many, source, max_tokens=8)[0] == [p[:8] for p in plain * 4]
        assert first.stats.trees_sent > 0 and second.stats.trees_sent > 0
        resyncs = source.counters.resyncs

        def scale_down() -> None:
            source.set_endpoints([f"127.0.0.1:{second.port}"])

        outputs, stats = generate(runner, many, StopAfter(source, 3, scale_down))
        assert outputs == plain * 4
        assert [e.address for e in source.endpoints] == [f"127.0.0.1:{second.port}"]
        assert source.counters.resyncs > resyncs  # the first worker's sequences moved, whole
        assert source.counters.trees_invalid == stats.num_invalid_trees == 0
        assert stats.num_trees > stats.num_rounds  # still speculating after the move
    finally:
        source.close()
        first.stop(1)
        second.stop(1)
