"""`RemoteDraftSource`: the engine's DraftSource over the draft workers' gRPC streams.

`submit` records each update, routes it, opens its round and sends its wire form (a full
re-sync where needed); `collect` returns the trees that came in time. One lock (`_cond`)
guards the routing, the sequences, the rounds and every endpoint's liveness, shared by the
parts in this package: what the engine calls and what the receive threads deliver change
them together.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import replace

import torch

from outrider.proto import FEATURE_DTYPES, CandidateTree, FeatureSpec, HandshakeRequest, SequenceUpdate
from outrider.proto import outrider_pb2 as pb
from outrider.target_worker.draft_client.config import DraftClientConfig, DraftClientCounters
from outrider.target_worker.draft_client.handshake import FeatureAgreement
from outrider.target_worker.draft_client.rounds import Awaited, Rounds
from outrider.target_worker.draft_client.routing import SyncedSequence, fit_budget, route
from outrider.target_worker.draft_client.spec_cache import PushedTrees
from outrider.target_worker.draft_client.transport import Connections, Endpoint
from outrider.target_worker.draft_source import DraftSource, projected_update


class RemoteDraftSource(DraftSource):
    validates_trees = True  # `Rounds.receive` checks them on arrival, before `collect` sees them
    overlaps_drafting = True  # the draft workers draft while the engine verifies the other lane

    def __init__(
        self, addresses: Sequence[str], handshake: HandshakeRequest, config: DraftClientConfig | None = None
    ):
        if not addresses:
            raise ValueError("RemoteDraftSource needs at least one draft worker address")
        self.handshake, self.config = handshake, config or DraftClientConfig()
        self.trusts_q = self.config.trust_q
        self.counters = DraftClientCounters()
        self._cond = threading.Condition()  # the one lock (module docstring)
        self._features = FeatureAgreement(self.config.features)
        self._seqs: dict[int, SyncedSequence] = {}
        self._rounds = Rounds(self._cond, self._seqs, self.counters, handshake.vocab_size)
        self.pushed = PushedTrees(self._rounds, self.counters, handshake.vocab_size)
        self._connections = Connections(
            handshake,
            self.config,
            self._cond,
            self._features,
            self.counters,
            on_message=self._receive,
            on_lost=self._rounds.forget_endpoint,
        )
        self.set_endpoints(addresses)

    @property
    def endpoints(self) -> list[Endpoint]:
        return self._connections.endpoints

    @property
    def feature_spec(self) -> FeatureSpec:
        return self._features.spec

    @property
    def label(self) -> str:
        return "draft workers " + ", ".join(e.address for e in self.endpoints)

    def feature_projection(self) -> torch.Tensor | None:
        return self._features.projection

    def wait_ready(self, timeout_s: float) -> bool:
        """True once some worker is connected; HandshakeMismatchError if every worker refused."""
        return self._connections.wait_ready(timeout_s)

    def set_endpoints(self, addresses: Sequence[str]) -> None:
        """Follow the draft pool as it scales: connect to new addresses, leave the ones gone.

        Sequences on a removed worker move to another (a re-sync with their whole context) on
        their next round, exactly as if that worker had died; the others stay where they are.
        """
        self._connections.set_addresses(addresses)

    def close(self) -> None:
        self._connections.close()

    # ------------------------------------------------------------------ the engine's side

    def submit(self, updates: Sequence[SequenceUpdate]) -> None:
        outgoing: dict[Endpoint, list[pb.SequenceUpdate]] = {}
        with self._cond:
            for update in updates:
                message, endpoint = self._prepare(update)
                if message is not None and endpoint is not None:
                    outgoing.setdefault(endpoint, []).append(message)
            for endpoint, messages in outgoing.items():
                step = endpoint.limits.max_batch
                for start in range(0, len(messages), step):
                    endpoint.outbox.put(pb.DraftRequest(updates=messages[start : start + step]))

    def collect(self, seq_ids: Sequence[int], timeout_s: float | None = None) -> dict[int, CandidateTree]:
        """Trees that arrive within `timeout_s` (None: the configured round deadline, never forever)."""
        return self._rounds.collect(seq_ids, self.config.round_deadline_s if timeout_s is None else timeout_s)

    def _prepare(self, update: SequenceUpdate) -> tuple[pb.SequenceUpdate | None, Endpoint | None]:
        """Record the update, route it, and make its wire form (a full re-sync where needed)."""
        seq_id, state = update.seq_id, self._seqs.get(update.seq_id)
        self._rounds.drop(seq_id)
        if update.features is not None and not self._features.spec.needs_features:
            update = replace(update, features=None)
        if update.finished:
            self._seqs.pop(seq_id, None)
            self.pushed.forget(seq_id)
            synced = state is not None and state.endpoint is not None and state.in_sync()
            return (self._wire(update), state.endpoint) if synced else (None, None)
        delta = tuple(update.new_tokens.tolist())
        whole = state is None or update.reset  # the update already carries the whole context
        if whole:
            state = self._seqs[seq_id] = SyncedSequence.start(update)
            self.pushed.forget(seq_id)
        else:
            state.extend(update)
        endpoint = route(seq_id, state.endpoint, self.endpoints)
        if endpoint is None:
            return None, None  # no worker: this sequence decodes unspeculated
        stale = state.stale_on(endpoint)
        if not whole and (stale or state.misses >= self.config.resync_after_misses):
            self.counters.resyncs += 1
            update = state.whole(update)
        elif whole:
            update = replace(update, reset=True)
        state.synced_on(endpoint)
        if update.reset:
            state.clear_misses()
        budget = fit_budget(update.budget, endpoint.limits)
        self._rounds.open(seq_id, Awaited(update.round, budget, int(update.new_tokens[-1]), endpoint, delta))
        # A pushed guess for this delta answers the round now; the update then tells the
        # worker so (it sends no duplicate, and knows its guess was in time).
        answered = self.pushed.on_submit(seq_id, endpoint, budget, delta, update.round, stale or update.reset)
        return self._wire(replace(update, budget=budget, answered=answered)), endpoint

    def _wire(self, update: SequenceUpdate) -> pb.SequenceUpdate:
        """The update's wire form: features projected (when agreed) and in the agreed dtype.

        Sequences keep their raw features, so a re-sync after a reconnect (or to a worker with
        another projection) is projected afresh; bf16/fp16 halve the bytes of fp32.
        """
        if update.features is not None:
            features = update.features
            if self._features.spec.projected:
                features = projected_update(update, self._features.projection).features
            features = features.to(FEATURE_DTYPES[self._features.spec.dtype])
            update = replace(update, features=features)
        return update.to_proto()

    # ------------------------------------------------------------------ a receive thread's side

    def _receive(self, endpoint: Endpoint, message: pb.DraftResponse) -> None:
        with self._cond:
            if message.speculative:
                self.pushed.receive(endpoint, message.speculative)
            self._rounds.receive(endpoint, message.trees, self.pushed.answered)
