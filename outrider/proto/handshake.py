"""The handshake: what draft and target tell each other once, before any draft flows.

A drafter is only useful for the target it was built against: a different vocabulary makes
every token id mean something else, and the wrong feature layers give garbage drafts. Both
would still *verify* losslessly, just with τ near 1, so the mismatch would show up as a
slow server rather than an error. The handshake refuses such a pair at connect time and
names every mismatch at once, so one restart fixes them all.

The target (the gRPC client) sends a HandshakeRequest, the drafter answers with a
HandshakeResponse, and the target calls `check_handshake` to get the negotiated Limits.

The restart fence: the response carries the server's `incarnation`, drawn when it started.
The target opens its Draft stream with it in the `INCARNATION_METADATA` key, and a server
that is another incarnation refuses the stream (`stale_incarnation`): the channel reached a
restarted process that never saw the handshake and holds none of the target's sequences.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass

from outrider.proto import outrider_pb2 as pb
from outrider.proto.errors import HandshakeMismatchError
from outrider.proto.tensor import FEATURE_DTYPES

PROTOCOL_VERSION = pb.PROTOCOL_VERSION_1


def vocab_fingerprint(vocab: Mapping[str, int]) -> str:
    """sha256 hex of a tokenizer's vocabulary (`tokenizer.get_vocab()`).

    Hashes the (token, id) pairs sorted by token, as compact UTF-8 JSON, so the result does
    not depend on dict order, platform or tokenizer library.
    """
    pairs = sorted(vocab.items())
    encoded = json.dumps(pairs, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    return hashlib.sha256(encoded).hexdigest()


@dataclass(frozen=True)
class Limits:
    """The most one peer can handle; negotiated limits are the element-wise minimum."""

    max_batch: int  # sequences per DraftRequest / DraftResponse
    max_nodes: int  # nodes per candidate tree, root included
    max_depth: int  # draft tokens on any root-to-leaf path
    max_top_k: int  # children per node
    max_q_width: int = 0  # entries per sparse q row; given below max_top_k (0): max_top_k

    def __post_init__(self) -> None:  # stored resolved, as TreeBudget.q_width
        object.__setattr__(self, "max_q_width", max(self.max_top_k, self.max_q_width))

    def intersect(self, other: Limits) -> Limits:
        return Limits(
            max_batch=min(self.max_batch, other.max_batch),
            max_nodes=min(self.max_nodes, other.max_nodes),
            max_depth=min(self.max_depth, other.max_depth),
            max_top_k=min(self.max_top_k, other.max_top_k),
            max_q_width=min(self.max_q_width, other.max_q_width),
        )

    def to_proto(self) -> pb.Limits:
        return pb.Limits(
            max_batch=self.max_batch,
            max_nodes=self.max_nodes,
            max_depth=self.max_depth,
            max_top_k=self.max_top_k,
            max_q_width=self.max_q_width,
        )

    @classmethod
    def from_proto(cls, message: pb.Limits) -> Limits:
        return cls(
            max_batch=message.max_batch,
            max_nodes=message.max_nodes,
            max_depth=message.max_depth,
            max_top_k=message.max_top_k,
            max_q_width=message.max_q_width,
        )


@dataclass(frozen=True)
class FeatureSpec:
    """The target features a drafter consumes with each new token (EAGLE-3: three layers)."""

    layer_ids: tuple[int, ...] = ()  # target layers to tap; () = no features
    hidden_size: int = 0  # H of the target
    projected: bool = False  # True: the target applies the drafter's fc and sends H values
    dtype: str = "bfloat16"  # a FEATURE_DTYPES name

    @property
    def needs_features(self) -> bool:
        return bool(self.layer_ids)

    @property
    def width(self) -> int:
        """Values per token on the wire: the second dim of SequenceUpdate.features."""
        if not self.layer_ids:
            return 0
        return self.hidden_size if self.projected else len(self.layer_ids) * self.hidden_size

    def to_proto(self) -> pb.FeatureSpec:
        return pb.FeatureSpec(
            layer_ids=list(self.layer_ids),
            hidden_size=self.hidden_size,
            projected=self.projected,
            dtype=self.dtype,
        )

    @classmethod
    def from_proto(cls, message: pb.FeatureSpec) -> FeatureSpec:
        return cls(
            layer_ids=tuple(message.layer_ids),
            hidden_size=message.hidden_size,
            projected=message.projected,
            dtype=message.dtype,
        )


@dataclass(frozen=True)
class HandshakeRequest:
    """Target -> draft: what the target serves and the most it can verify."""

    target_model_id: str
    vocab_size: int
    vocab_fingerprint: str  # vocab_fingerprint() of the target's tokenizer
    target_num_layers: int
    target_hidden_size: int
    limits: Limits
    method: str = ""  # the proposer the target is configured for; "" = any
    protocol_version: int = PROTOCOL_VERSION

    def to_proto(self) -> pb.HandshakeRequest:
        return pb.HandshakeRequest(
            protocol_version=self.protocol_version,
            target_model_id=self.target_model_id,
            vocab_size=self.vocab_size,
            vocab_fingerprint=self.vocab_fingerprint,
            method=self.method,
            target_num_layers=self.target_num_layers,
            target_hidden_size=self.target_hidden_size,
            limits=self.limits.to_proto(),
        )

    @classmethod
    def from_proto(cls, message: pb.HandshakeRequest) -> HandshakeRequest:
        return cls(
            target_model_id=message.target_model_id,
            vocab_size=message.vocab_size,
            vocab_fingerprint=message.vocab_fingerprint,
            target_num_layers=message.target_num_layers,
            target_hidden_size=message.target_hidden_size,
            limits=Limits.from_proto(message.limits),
            method=message.method,
            protocol_version=message.protocol_version,
        )


@dataclass(frozen=True)
class HandshakeResponse:
    """Draft -> target: what the drafter is, what it was trained against, what it needs."""

    draft_model_id: str
    vocab_size: int
    vocab_fingerprint: str
    method: str  # e.g. "ngram", "draft_model", "eagle3", "medusa", "mtp"
    limits: Limits
    features: FeatureSpec = FeatureSpec()
    target_model_id: str = ""  # the target this drafter was trained for; "" = any
    protocol_version: int = PROTOCOL_VERSION
    projection_sha256: str = ""  # set iff features.projected: the fc the target must apply
    incarnation: int = 0  # drawn at the server's start; 0 = a server that does not say (no fence)

    def to_proto(self) -> pb.HandshakeResponse:
        return pb.HandshakeResponse(
            protocol_version=self.protocol_version,
            draft_model_id=self.draft_model_id,
            target_model_id=self.target_model_id,
            vocab_size=self.vocab_size,
            vocab_fingerprint=self.vocab_fingerprint,
            method=self.method,
            features=self.features.to_proto(),
            limits=self.limits.to_proto(),
            projection_sha256=self.projection_sha256,
            incarnation=self.incarnation,
        )

    @classmethod
    def from_proto(cls, message: pb.HandshakeResponse) -> HandshakeResponse:
        return cls(
            draft_model_id=message.draft_model_id,
            vocab_size=message.vocab_size,
            vocab_fingerprint=message.vocab_fingerprint,
            method=message.method,
            limits=Limits.from_proto(message.limits),
            features=FeatureSpec.from_proto(message.features),
            target_model_id=message.target_model_id,
            protocol_version=message.protocol_version,
            projection_sha256=message.projection_sha256,
            incarnation=message.incarnation,
        )


def check_handshake(request: HandshakeRequest, response: HandshakeResponse) -> Limits:
    """The negotiated Limits, or HandshakeMismatchError listing every mismatch."""
    mismatches = []
    for side, version in (("target", request.protocol_version), ("draft", response.protocol_version)):
        if version != PROTOCOL_VERSION:
            mismatches.append(
                f"protocol_version: {side} speaks {version}, this build speaks {PROTOCOL_VERSION}"
            )
    if request.vocab_size != response.vocab_size:
        mismatches.append(f"vocab_size: target {request.vocab_size}, draft {response.vocab_size}")
    if request.vocab_fingerprint != response.vocab_fingerprint:
        mismatches.append(
            f"vocab_fingerprint: target {request.vocab_fingerprint[:16]}…, "
            f"draft {response.vocab_fingerprint[:16]}… (the tokenizers differ)"
        )
    if response.target_model_id and response.target_model_id != request.target_model_id:
        mismatches.append(
            f"target_model_id: the drafter was built for {response.target_model_id!r}, "
            f"the target serves {request.target_model_id!r}"
        )
    if request.method and request.method != response.method:
        mismatches.append(
            f"method: the target expects {request.method!r}, the drafter runs {response.method!r}"
        )
    mismatches.extend(_feature_mismatches(request, response.features))
    if response.features.projected and not response.projection_sha256:
        mismatches.append(
            "features.projected: the drafter asks for projected features but publishes no projection"
        )
    limits = request.limits.intersect(response.limits)
    for name, least in (("max_batch", 1), ("max_nodes", 2), ("max_depth", 1), ("max_top_k", 1)):
        agreed, target, draft = (getattr(side, name) for side in (limits, request.limits, response.limits))
        if agreed < least:
            mismatches.append(
                f"limits.{name}: negotiated {agreed} (target {target}, draft {draft}), "
                f"below the {least} any draft needs"
            )
    if mismatches:
        raise HandshakeMismatchError(mismatches)
    return limits


def _feature_mismatches(request: HandshakeRequest, features: FeatureSpec) -> list[str]:
    if not features.needs_features:
        return []
    mismatches = []
    # Layer L (= target_num_layers) is the final hidden state after the last norm.
    missing = [layer for layer in features.layer_ids if layer > request.target_num_layers]
    if missing:
        mismatches.append(
            f"features.layer_ids: layers {missing} do not exist in the target's "
            f"{request.target_num_layers} layers (layer {request.target_num_layers} = the final hidden state)"
        )
    if len(set(features.layer_ids)) != len(features.layer_ids):
        mismatches.append(f"features.layer_ids: {list(features.layer_ids)} names a layer twice")
    if features.hidden_size != request.target_hidden_size:
        mismatches.append(
            f"features.hidden_size: the drafter expects {features.hidden_size}, "
            f"the target's hidden size is {request.target_hidden_size}"
        )
    if features.dtype not in FEATURE_DTYPES:
        mismatches.append(f"features.dtype: {features.dtype!r} is not one of {sorted(FEATURE_DTYPES)}")
    return mismatches


INCARNATION_METADATA = "outrider-incarnation"  # Draft stream metadata: the incarnation handshook with
TARGET_METADATA = "outrider-target"  # Draft stream metadata: the target's label, for per-target counters
STALE_INCARNATION = "stale incarnation"  # how the ABORTED details of a refused stream begin


def stale_incarnation(metadata, incarnation: int) -> str | None:
    """Why a Draft stream opened with `metadata` must be refused by server `incarnation`; None if
    it may go on (the same incarnation, or a target that does not say)."""
    sent = dict(metadata or ()).get(INCARNATION_METADATA)
    if sent is None or sent == str(incarnation):
        return None
    return (
        f"{STALE_INCARNATION}: the stream was opened for draft server incarnation {sent}, "
        f"this is {incarnation} (restarted since the handshake); handshake again"
    )
