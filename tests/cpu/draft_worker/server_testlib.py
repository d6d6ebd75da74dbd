"""Shared by the draft server tests: one raw Draft stream, as a target would hold it."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator

import grpc

from outrider.proto import outrider_pb2 as pb
from outrider.proto import outrider_pb2_grpc as pb_grpc


class Stream:
    """One raw Draft stream: `send` requests, `trees` waits for answers."""

    def __init__(self, channel: grpc.Channel, metadata: tuple = ()):
        self.requests: queue.SimpleQueue = queue.SimpleQueue()
        self.call = pb_grpc.DraftServiceStub(channel).Draft(self._iterate(), metadata=metadata or None)
        self.received: queue.SimpleQueue = queue.SimpleQueue()
        self.error: grpc.RpcError | None = None
        self.ended = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _iterate(self) -> Iterator[pb.DraftRequest]:
        while (item := self.requests.get()) is not None:
            yield item

    def _read(self) -> None:
        try:
            for response in self.call:
                for tree in response.trees:
                    self.received.put(tree)
        except grpc.RpcError as error:
            self.error = error
        self.ended.set()

    def send(self, *updates: pb.SequenceUpdate) -> None:
        self.requests.put(pb.DraftRequest(updates=list(updates)))

    def trees(self, count: int, timeout_s: float = 5.0) -> dict[int, pb.CandidateTree]:
        out = {}
        for _ in range(count):
            tree = self.received.get(timeout=timeout_s)
            out[tree.seq_id] = tree
        return out
