"""The restart fence: a draft server's incarnation in the handshake, checked when the stream opens.

A draft replica restarted on the same address is a new process that holds none of the
target's sequences. Its handshake says so (a new `incarnation`); a Draft stream opened for the
old one (the channel reconnected in between) is refused with ABORTED, and the target
handshakes again and re-sends every sequence whole. Greedy output never changes.
"""

from __future__ import annotations

import time

import grpc
import pytest
from draft_client_testlib import (
    StopAfter,
    client,
    encode_prompts,
    generate,
    load_runner,
    start_server,
    target_handshake,
)

from outrider.proto import INCARNATION_METADATA, STALE_INCARNATION, HandshakeResponse
from outrider.proto import outrider_pb2_grpc as pb_grpc
from outrider.target_worker.draft_client import transport


def free_address() -> str:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{probe.getsockname()[1]}"


def test_each_server_start_is_a_new_incarnation_and_a_stale_stream_is_refused(tiny_family):
    first, second = start_server(tiny_family), start_server(tiny_family)
    try:
        stubs = [
            pb_grpc.DraftServiceStub(grpc.insecure_channel(f"127.0.0.1:{s.port}")) for s in (first, second)
        ]
        request = target_handshake(tiny_family).to_proto()
        a, b = (HandshakeResponse.from_proto(stub.Handshake(request, timeout=5)) for stub in stubs)
        assert a.incarnation and b.incarnation and a.incarnation != b.incarnation
        # A stream opened on `second` for `first`'s incarnation: refused, saying why.
        stale = stubs[1].Draft(iter(()), metadata=((INCARNATION_METADATA, str(a.incarnation)),), timeout=5)
        with pytest.raises(grpc.RpcError) as refused:
            list(stale)
        assert refused.value.code() == grpc.StatusCode.ABORTED
        assert STALE_INCARNATION in refused.value.details()
        # Its own incarnation, or none (an older target): the stream is served.
        for metadata in (((INCARNATION_METADATA, str(b.incarnation)),), ()):
            assert list(stubs[1].Draft(iter(()), metadata=metadata, timeout=5)) == []
    finally:
        first.stop(grace_s=0.5)
        second.stop(grace_s=0.5)


def test_a_restart_on_the_same_address_is_fenced_and_resynced(tiny_family):
    runner = load_runner(tiny_family.target_dir)
    prompts = encode_prompts(tiny_family.tokenizer_dir)
    plain = generate(runner, prompts)[0]
    address = free_address()
    servers = [start_server(tiny_family, address=address)]
    source = client(tiny_family, [address], round_deadline_s=5.0)

    def restart() -> None:
        servers[0].stop(grace_s=0.2)
        servers.append(start_server(tiny_family, address=address))
        deadline = time.monotonic() + 10
        while source.counters.draft_restarts == 0 or not source.endpoints[0].healthy:
            assert time.monotonic() < deadline
            time.sleep(0.01)

    try:
        assert source.wait_ready(20)
        before = source.endpoints[0].incarnation
        outputs, stats = generate(runner, prompts, StopAfter(source, 4, restart))
        assert outputs == plain
        assert source.endpoints[0].incarnation not in (0, before)
        assert source.counters.draft_restarts == 1
        assert source.counters.resyncs >= len(prompts)  # every sequence re-sent whole to the new process
        assert stats.num_trees > 0 and source.counters.trees_invalid == 0
    finally:
        source.close()
        servers[-1].stop(grace_s=0.2)


def test_the_target_hands_a_stale_stream_back_and_handshakes_again(tiny_family, monkeypatch):
    """The channel reaches a restarted process between Handshake and Draft: the first handshake
    here answers with an incarnation the server is not (what the old process would have said)."""
    lied = []

    class StaleOnce(pb_grpc.DraftServiceStub):
        def __init__(self, channel):
            super().__init__(channel)
            real = self.Handshake

            def handshake(request, **kwargs):
                reply = real(request, **kwargs)
                if not lied:
                    lied.append(reply.incarnation)
                    reply.incarnation += 2  # the process this server replaced
                return reply

            self.Handshake = handshake

    monkeypatch.setattr(transport.pb_grpc, "DraftServiceStub", StaleOnce)
    runner = load_runner(tiny_family.target_dir)
    prompts = encode_prompts(tiny_family.tokenizer_dir)
    plain = generate(runner, prompts)[0]
    server = start_server(tiny_family)
    source = client(tiny_family, [f"127.0.0.1:{server.port}"], round_deadline_s=5.0)
    try:
        assert source.wait_ready(20)
        deadline = time.monotonic() + 10
        endpoint = source.endpoints[0]
        while source.counters.stale_streams == 0 or endpoint.incarnation != lied[0] or not endpoint.healthy:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert source.endpoints[0].incarnation == lied[0]  # the true one, from the second handshake
        assert source.counters.draft_restarts == 1
        outputs, stats = generate(runner, prompts, source)
        assert outputs == plain and stats.num_trees > 0
    finally:
        source.close()
        server.stop(grace_s=0.2)
