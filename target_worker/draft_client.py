"""The target's gRPC draft source: remote draft workers behind the engine's DraftSource.

    engine ── submit(updates) ──> RemoteDraftSource ── DraftRequest ══> draft worker 0
                                   │ routes each seq_id to one healthy ══> draft worker 1
    engine <── collect(ids, t) ─── │ worker (rendezvous hash, sticky) <══ DraftResponse
                                   └ one thread per worker: handshake, stream, receive, reconnect

The engine never waits past its round deadline: `collect` returns whatever valid trees came
in time, and a sequence without one decodes unspeculated that round. Everything that arrives
is checked (`proto.receive_trees`, plus the root token and the round); a bad tree is dropped
and counted, never raised.

A draft worker keeps per-sequence state built from the deltas it was sent, so the client
keeps each live sequence's full context (and features, for EAGLE-style drafters) and sends
it whole (`reset=True`) whenever the worker cannot have it: a reconnect (the worker may have
restarted), a move to another worker, or several rounds with no answer at all (the worker
dropped it). Features travel as raw bytes in the handshake's dtype; with a `projected`
feature spec the engine applies the drafter's fc first and hands over H values per token.

Longer than 400 lines because one lock guards the routing, the sequences and every
endpoint's liveness; splitting the connection loop out would spread that lock over files.
"""

from __future__ import annotations

import hashlib
import json
import logging
import queue
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import grpc
import torch

from outrider.proto import (
    FEATURE_DTYPES,
    CandidateTree,
    FeatureSpec,
    HandshakeMismatchError,
    HandshakeRequest,
    HandshakeResponse,
    InvalidDraftError,
    Limits,
    SequenceUpdate,
    TreeBudget,
    check_handshake,
    check_trees,
    join_projection,
    receive_trees,
    vocab_fingerprint,
)
from outrider.proto import outrider_pb2 as pb
from outrider.proto import outrider_pb2_grpc as pb_grpc
from outrider.target_worker.draft_source import DraftSource, projected_update

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ClientTls:
    """PEM bytes: the CA that signed the draft servers, and our own pair for mutual TLS."""

    root_ca: bytes
    cert_chain: bytes | None = None
    private_key: bytes | None = None
    server_name: str | None = None  # the name to expect in the server's certificate, if not the host


@dataclass(frozen=True)
class DraftClientConfig:
    round_deadline_s: float = 0.05  # what collect(timeout_s=None) waits at most
    connect_timeout_s: float = 2.0  # per handshake attempt
    backoff_initial_s: float = 0.05  # reconnect delay, doubled per failed attempt
    backoff_max_s: float = 2.0
    resync_after_misses: int = 3  # rounds with no answer at all before a sequence is re-sent whole
    max_message_bytes: int = 64 << 20
    token: str | None = None  # sent as `authorization: Bearer <token>` on every call
    tls: ClientTls | None = None
    features: FeatureSpec = FeatureSpec()  # expected until a worker's handshake says otherwise


@dataclass
class DraftClientCounters:
    trees_received: int = 0  # valid and in time for their round
    trees_late: int = 0  # arrived after their round was collected
    trees_invalid: int = 0  # failed validation; dropped
    trees_missing: int = 0  # rounds that `collect` closed without a tree
    reconnects: int = 0  # streams re-established after one was lost
    resyncs: int = 0  # full contexts re-sent (worker restarted, sequence moved, dropped)
    handshake_refusals: int = 0
    trees_pushed_used: int = 0  # rounds a pre-drafted tree answered before they were asked (also received)
    trees_pushed_dropped: int = 0  # pre-drafted trees that failed their checks (malformed, over budget)


def tokenizer_fingerprint(tokenizer_dir: str | Path) -> str:
    """`vocab_fingerprint` of a `tokenizer.json` folder; draft and target must call the same."""
    from tokenizers import Tokenizer

    return vocab_fingerprint(Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json")).get_vocab())


def target_handshake(
    model_dir: str | Path, tokenizer_dir: str | Path, *, model_id: str, limits: Limits, method: str = ""
) -> HandshakeRequest:
    """The handshake a target serving the Hugging Face folder `model_dir` sends at connect."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return HandshakeRequest(
        target_model_id=model_id,
        vocab_size=config["vocab_size"],
        vocab_fingerprint=tokenizer_fingerprint(tokenizer_dir),
        target_num_layers=config["num_hidden_layers"],
        target_hidden_size=config["hidden_size"],
        limits=limits,
        method=method,
    )


@dataclass
class _Sequence:
    tokens: list[torch.Tensor]  # the full context, as the chunks it arrived in
    features: list[torch.Tensor] | None  # [n_i, width] chunks, when the drafter needs features
    endpoint: _Endpoint | None = None  # where it is synced
    generation: int = -1  # that endpoint's stream generation when it was synced
    misses: int = 0  # consecutive rounds with no answer
    budget: TreeBudget | None = None  # of its last update
    # Pre-drafted trees the worker pushed (SpeculativeTree), still as received: the delta
    # they assume -> the message. Only the one whose delta comes true is decoded and checked.
    pushed: dict[tuple[int, ...], pb.SpeculativeTree] = field(default_factory=dict)
    answered: int = -1  # the last round a pushed tree answered; the worker's own answer is a duplicate


@dataclass
class _Awaited:
    round: int
    budget: TreeBudget
    root: int  # the token the tree's node 0 must hold
    endpoint: _Endpoint
    delta: tuple[int, ...] = ()  # the update's new tokens, which a pushed tree must have assumed


@dataclass(eq=False)
class _Endpoint:
    address: str
    healthy: bool = False
    generation: int = 0  # bumped on every stream opened: the worker's state may be gone
    limits: Limits | None = None
    last_error: Exception | None = None
    refused: bool = False  # the last handshake was a mismatch
    removed: bool = False  # dropped by set_endpoints: its thread ends
    outbox: queue.SimpleQueue | None = None  # the live stream's requests; None ends it
    call: grpc.Future | None = None
    thread: threading.Thread | None = field(default=None, repr=False)


class RemoteDraftSource(DraftSource):
    validates_trees = True  # `receive_trees` + root check in `_receive`, before `collect` sees them
    overlaps_drafting = True  # the draft workers draft while the engine verifies the other lane

    def __init__(
        self, addresses: Sequence[str], handshake: HandshakeRequest, config: DraftClientConfig | None = None
    ):
        if not addresses:
            raise ValueError("RemoteDraftSource needs at least one draft worker address")
        self.handshake, self.config = handshake, config or DraftClientConfig()
        self.counters = DraftClientCounters()
        self._features = self.config.features
        self._features_agreed = False  # set by the first accepted handshake
        self._projection: torch.Tensor | None = None  # the drafters' fc, for a projected spec
        self._projection_sha256 = ""
        self._cond = threading.Condition()
        self._closed = threading.Event()
        self._seqs: dict[int, _Sequence] = {}
        self._awaiting: dict[int, _Awaited] = {}
        self._ready: dict[int, CandidateTree] = {}
        self.endpoints: list[_Endpoint] = []
        self.set_endpoints(addresses)

    @property
    def feature_spec(self) -> FeatureSpec:
        return self._features

    def feature_projection(self) -> torch.Tensor | None:
        return self._projection

    def wait_ready(self, timeout_s: float) -> bool:
        """True once some worker is connected; HandshakeMismatchError if every worker refused."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while not any(e.healthy for e in self.endpoints):
                refusals = [e.last_error for e in self.endpoints if e.refused]
                if len(refusals) == len(self.endpoints):
                    raise refusals[0]
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 0.05))
        return True

    # ------------------------------------------------------------------ the engine's side

    def submit(self, updates: Sequence[SequenceUpdate]) -> None:
        outgoing: dict[_Endpoint, list[pb.SequenceUpdate]] = {}
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
        deadline = time.monotonic() + (self.config.round_deadline_s if timeout_s is None else timeout_s)
        with self._cond:
            while any(s in self._awaiting for s in seq_ids):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            trees = {s: self._ready.pop(s) for s in seq_ids if s in self._ready}
            for seq_id in seq_ids:
                # The round is closed: a tree arriving from now on is late.
                awaited = self._awaiting.pop(seq_id, None)
                state = self._seqs.get(seq_id)
                if seq_id in trees or state is None:
                    continue
                self.counters.trees_missing += 1
                if awaited is not None and awaited.endpoint.healthy:
                    state.misses += 1
        return trees

    def set_endpoints(self, addresses: Sequence[str]) -> None:
        """Follow the draft pool as it scales: connect to new addresses, leave the ones gone.

        Sequences on a removed worker move to another (a re-sync with their whole context) on
        their next round, exactly as if that worker had died; the others stay where they are.
        """
        wanted = list(dict.fromkeys(addresses))
        if not wanted:
            raise ValueError("RemoteDraftSource needs at least one draft worker address")
        with self._cond:
            held = {e.address: e for e in self.endpoints}
            gone = [e for e in self.endpoints if e.address not in wanted]
            added = [_Endpoint(address) for address in wanted if address not in held]
            self.endpoints = [
                held.get(address) or next(e for e in added if e.address == address) for address in wanted
            ]
            for endpoint in gone:
                endpoint.removed = True
                self._hang_up(endpoint)
        for endpoint in added:
            endpoint.thread = threading.Thread(
                target=self._connection_loop,
                args=(endpoint,),
                name=f"draft-client-{endpoint.address}",
                daemon=True,
            )
            endpoint.thread.start()  # a removed endpoint's thread ends on its own within a backoff

    def close(self) -> None:
        self._closed.set()
        with self._cond:
            for endpoint in self.endpoints:
                self._hang_up(endpoint)
        for endpoint in self.endpoints:
            endpoint.thread.join(timeout=5)

    def _hang_up(self, endpoint: _Endpoint) -> None:
        """End the endpoint's stream (under the lock): half-close, then cancel."""
        if endpoint.outbox is not None:
            endpoint.outbox.put(None)  # half-close: the worker finishes, then ends the stream
        if endpoint.call is not None:
            endpoint.call.cancel()
        endpoint.healthy = False
        self._cond.notify_all()

    def _prepare(self, update: SequenceUpdate) -> tuple[pb.SequenceUpdate | None, _Endpoint | None]:
        """Record the update, route it, and make its wire form (a full re-sync where needed)."""
        seq_id, state = update.seq_id, self._seqs.get(update.seq_id)
        self._ready.pop(seq_id, None)
        self._awaiting.pop(seq_id, None)
        if update.features is not None and not self._features.needs_features:
            update = replace(update, features=None)
        if update.finished:
            self._seqs.pop(seq_id, None)
            synced = state is not None and state.endpoint is not None and _in_sync(state)
            return (self._wire(update), state.endpoint) if synced else (None, None)
        features = [update.features] if update.features is not None else None
        delta = tuple(update.new_tokens.tolist())
        if state is None or update.reset:
            state = self._seqs[seq_id] = _Sequence([update.new_tokens], features)
            whole = True  # the update already carries the whole context
        else:
            state.tokens.append(update.new_tokens)
            if state.features is not None and features is not None:
                state.features.extend(features)
            whole = False
        endpoint = self._route(seq_id, state)
        if endpoint is None:
            return None, None  # no worker: this sequence decodes unspeculated
        stale = state.endpoint is not endpoint or state.generation != endpoint.generation
        if not whole and (stale or state.misses >= self.config.resync_after_misses):
            self.counters.resyncs += 1
            update = self._whole(update, state)
        elif whole:
            update = replace(update, reset=True)
        state.endpoint, state.generation = endpoint, endpoint.generation
        if update.reset:
            state.misses = 0
        budget = _fit(update.budget, endpoint.limits)
        root = int(update.new_tokens[-1])
        self._awaiting[seq_id] = _Awaited(update.round, budget, root, endpoint, delta)
        pushed = state.pushed.get(delta) if not (stale or update.reset) else None
        state.pushed, state.budget = {}, budget
        answered = False
        if pushed is not None and pushed.tree.round == update.round:
            tree = self._checked_pushed(endpoint, pushed, budget, delta)
            if tree is not None:
                self._answer(seq_id, state, tree)  # the worker guessed this outcome: no waiting
                answered = True  # so it sends no duplicate, and knows its guess was in time
        return self._wire(replace(update, budget=budget, answered=answered)), endpoint

    def _answer(self, seq_id: int, state: _Sequence, tree: CandidateTree) -> None:
        """A pushed tree answers the awaited round (under the lock)."""
        del self._awaiting[seq_id]
        self._ready[seq_id] = tree
        state.misses, state.answered = 0, tree.round
        self.counters.trees_received += 1
        self.counters.trees_pushed_used += 1
        self._cond.notify_all()

    def _whole(self, update: SequenceUpdate, state: _Sequence) -> SequenceUpdate:
        tokens = torch.cat(state.tokens)
        state.tokens = [tokens]
        features = None
        if state.features is not None:
            features = torch.cat(state.features)
            state.features = [features]
        return replace(update, new_tokens=tokens, features=features, reset=True)

    def _wire(self, update: SequenceUpdate) -> pb.SequenceUpdate:
        """The update's wire form: features projected (when agreed) and in the agreed dtype.

        Sequences keep their raw features, so a re-sync after a reconnect (or to a worker with
        another projection) is projected afresh; bf16/fp16 halve the bytes of fp32.
        """
        if update.features is not None:
            features = update.features
            if self._features.projected:
                features = projected_update(update, self._projection).features
            features = features.to(FEATURE_DTYPES[self._features.dtype])
            update = replace(update, features=features)
        return update.to_proto()

    def _route(self, seq_id: int, state: _Sequence) -> _Endpoint | None:
        """Sticky: stay on the current worker while it is up; else the highest rendezvous hash."""
        if state.endpoint is not None and state.endpoint.healthy:
            return state.endpoint
        healthy = [e for e in self.endpoints if e.healthy]
        if not healthy:
            return None
        return max(healthy, key=lambda e: _rendezvous_weight(seq_id, e.address))

    # ------------------------------------------------------------------ one worker's thread

    def _connection_loop(self, endpoint: _Endpoint) -> None:
        backoff = self.config.backoff_initial_s
        metadata = (("authorization", f"Bearer {self.config.token}"),) if self.config.token else None
        while not (self._closed.is_set() or endpoint.removed):
            channel = self._channel(endpoint.address)
            try:
                stub = pb_grpc.DraftServiceStub(channel)
                if self._connect(endpoint, stub, metadata):
                    backoff = self.config.backoff_initial_s
                    self._receive_loop(endpoint)
            finally:
                channel.close()
            self._closed.wait(backoff)
            backoff = min(2 * backoff, self.config.backoff_max_s)

    def _connect(self, endpoint: _Endpoint, stub: pb_grpc.DraftServiceStub, metadata: tuple | None) -> bool:
        """Handshake and open the stream; False (with `last_error` set) if either fails."""
        try:
            reply = stub.Handshake(
                self.handshake.to_proto(), timeout=self.config.connect_timeout_s, metadata=metadata
            )
            response = HandshakeResponse.from_proto(reply)
            limits = check_handshake(self.handshake, response)
            projection = self._fetch_projection(stub, response, metadata)
            self._agree_features(endpoint, response, projection)
        except HandshakeMismatchError as error:
            self._refused(endpoint, error)
            return False
        except grpc.RpcError as error:
            if error.code() == grpc.StatusCode.FAILED_PRECONDITION:  # the worker refused us
                self._refused(endpoint, HandshakeMismatchError([f"{endpoint.address}: {error.details()}"]))
            else:
                endpoint.last_error = error
            return False
        outbox: queue.SimpleQueue = queue.SimpleQueue()
        with self._cond:
            if self._closed.is_set() or endpoint.removed:
                return False
            endpoint.call = stub.Draft(_drain(outbox), metadata=metadata)
            if endpoint.generation > 0:
                self.counters.reconnects += 1
            endpoint.generation += 1
            endpoint.limits, endpoint.outbox = limits, outbox
            endpoint.healthy, endpoint.refused, endpoint.last_error = True, False, None
            self._cond.notify_all()
        return True

    def _receive_loop(self, endpoint: _Endpoint) -> None:
        try:
            for message in endpoint.call:
                self._receive(endpoint, message)
        except grpc.RpcError as error:
            endpoint.last_error = error
            if not self._closed.is_set():
                log.warning("draft worker %s: stream lost (%s)", endpoint.address, error.code())
        finally:
            with self._cond:
                endpoint.healthy = False
                endpoint.outbox.put(None)
                # Its pending rounds will never be answered: let collect stop waiting for them.
                for seq_id in [s for s, a in self._awaiting.items() if a.endpoint is endpoint]:
                    del self._awaiting[seq_id]
                self._cond.notify_all()

    def _receive(self, endpoint: _Endpoint, message: pb.DraftResponse) -> None:
        with self._cond:
            current = []
            if message.speculative:
                self._receive_pushed(endpoint, message.speculative)
            for tree in message.trees:
                awaited = self._awaiting.get(tree.seq_id)
                if awaited is None or awaited.round != tree.round or awaited.endpoint is not endpoint:
                    state = self._seqs.get(tree.seq_id)
                    if state is not None and state.answered == tree.round:
                        continue  # a pushed tree already answered this round
                    self.counters.trees_late += 1
                    if state is not None:
                        state.misses = 0  # late, but the worker clearly holds the sequence
                    continue
                current.append(tree)
            if not current:
                return
            budgets = {tree.seq_id: self._awaiting[tree.seq_id].budget for tree in current}
            trees, errors = receive_trees(pb.DraftResponse(trees=current), budgets, self.handshake.vocab_size)
            for error in errors:
                log.debug("draft worker %s: dropped %s", endpoint.address, error)
            self.counters.trees_invalid += len(errors)
            awaited = {seq_id: self._awaiting.pop(seq_id) for seq_id in budgets}  # one answer per round
            for tree in trees:
                if int(tree.tokens[0]) != awaited[tree.seq_id].root:
                    self.counters.trees_invalid += 1
                    continue
                self.counters.trees_received += 1
                self._ready[tree.seq_id] = tree
                self._seqs[tree.seq_id].misses = 0
            self._cond.notify_all()

    def _receive_pushed(self, endpoint: _Endpoint, pushed: Sequence[pb.SpeculativeTree]) -> None:
        """Pre-drafted trees (under the lock): kept as received, decoded and checked only when
        their outcome comes true (`_checked_pushed`).

        This runs on the receive thread while the engine's thread verifies; Python work here
        holds the GIL that thread needs between its torch ops, and most guesses never come
        true, so a guess costs a dict entry until it is used.
        """
        for message in pushed:
            seq_id, delta, round_ = message.tree.seq_id, tuple(message.new_tokens), message.tree.round
            state = self._seqs.get(seq_id)
            if state is None or state.endpoint is not endpoint or state.budget is None or not delta:
                continue  # gone, moved, or never asked
            awaited = self._awaiting.get(seq_id)
            if awaited is not None and awaited.round == round_:  # its round is open already
                if awaited.delta == delta and awaited.endpoint is endpoint:
                    tree = self._checked_pushed(endpoint, message, awaited.budget, delta)
                    if tree is not None:
                        self._answer(seq_id, state, tree)
            elif round_ > state.answered and (awaited is None or round_ > awaited.round):
                state.pushed[delta] = message

    def _checked_pushed(
        self, endpoint: _Endpoint, message: pb.SpeculativeTree, budget: TreeBudget, delta: tuple[int, ...]
    ) -> CandidateTree | None:
        """The pushed tree, decoded and checked against the round's budget; None (counted) if bad.

        Unasked guesses are counted apart from invalid answers: one drafted under the last
        budget may not fit the next (it shrinks near max_tokens).
        """
        try:
            tree = CandidateTree.from_proto(message.tree)
            (error,) = check_trees([tree], [budget], self.handshake.vocab_size)
        except InvalidDraftError as invalid:
            error = invalid
        if error is None and int(tree.tokens[0]) != delta[-1]:
            error = "wrong root"
        if error is None:
            return tree
        log.debug("draft worker %s: dropped a pushed tree: %s", endpoint.address, error)
        self.counters.trees_pushed_dropped += 1
        return None

    def _fetch_projection(
        self, stub: pb_grpc.DraftServiceStub, response: HandshakeResponse, metadata: tuple | None
    ) -> torch.Tensor | None:
        """The worker's fc for a projected spec (fetched once per distinct sha256); else None."""
        if not response.features.projected:
            return None
        if response.projection_sha256 == self._projection_sha256:
            return self._projection
        chunk = min(1 << 20, self.config.max_message_bytes // 2)
        # Real projections are large (Llama-8B: 4096 x 12288 float32 = 200 MB): allow a minute.
        chunks = stub.FeatureProjection(
            pb.FeatureProjectionRequest(max_chunk_bytes=chunk),
            timeout=max(60.0, self.config.connect_timeout_s),
            metadata=metadata,
        )
        try:
            return join_projection(list(chunks), response.projection_sha256)
        except InvalidDraftError as error:
            raise HandshakeMismatchError([f"feature projection: {error}"]) from None

    def _agree_features(
        self, endpoint: _Endpoint, response: HandshakeResponse, projection: torch.Tensor | None
    ) -> None:
        """All workers must want the same features (and fc): the engine captures one set per round."""
        features, sha256 = response.features, response.projection_sha256
        with self._cond:
            if self._features_agreed and (features, sha256) != (self._features, self._projection_sha256):
                raise HandshakeMismatchError(
                    [
                        f"features: {endpoint.address} wants {features} (projection {sha256[:12] or 'none'}), "
                        f"the other draft workers {self._features} "
                        f"(projection {self._projection_sha256[:12] or 'none'})"
                    ]
                )
            self._features, self._features_agreed = features, True
            self._projection, self._projection_sha256 = projection, sha256

    def _refused(self, endpoint: _Endpoint, error: HandshakeMismatchError) -> None:
        log.error("draft worker %s refused: %s", endpoint.address, error)
        with self._cond:
            self.counters.handshake_refusals += 1
            endpoint.refused, endpoint.last_error = True, error
            self._cond.notify_all()

    def _channel(self, address: str) -> grpc.Channel:
        size = self.config.max_message_bytes
        options = [("grpc.max_receive_message_length", size), ("grpc.max_send_message_length", size)]
        tls = self.config.tls
        if tls is None:
            return grpc.insecure_channel(address, options=options)
        if tls.server_name:
            options.append(("grpc.ssl_target_name_override", tls.server_name))
        credentials = grpc.ssl_channel_credentials(tls.root_ca, tls.private_key, tls.cert_chain)
        return grpc.secure_channel(address, credentials, options=options)


def _drain(outbox: queue.SimpleQueue) -> Iterator[pb.DraftRequest]:
    """The request side of one Draft stream; ends (half-closes) at None."""
    while (request := outbox.get()) is not None:
        yield request


def _in_sync(state: _Sequence) -> bool:
    return state.endpoint.healthy and state.generation == state.endpoint.generation


def _fit(budget: TreeBudget, limits: Limits) -> TreeBudget:
    """The engine's budget cut to what this worker negotiated (the worker refuses anything over)."""
    return TreeBudget(
        max_nodes=max(1, min(budget.max_nodes, limits.max_nodes)),
        max_depth=min(budget.max_depth, limits.max_depth),
        top_k=min(budget.top_k, limits.max_top_k),
        q_width=min(budget.row_width, limits.q_width_limit),
    )


def _rendezvous_weight(seq_id: int, address: str) -> int:
    """Highest-random-weight hashing: when a worker leaves, only its sequences move."""
    digest = hashlib.blake2b(f"{seq_id}@{address}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")
