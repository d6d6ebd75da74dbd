"""Outrider's draft <-> target contract: `outrider.proto`, its stubs, typed mirrors, validation.

    outrider.proto          the wire contract (package outrider.v1); stubs: `python -m outrider.proto.generate`
    messages.py             target -> draft: SequenceUpdate and what it carries
    tree.py                 draft -> target: CandidateTree
    tensor.py               feature tensors as dtype + shape + bytes
    handshake.py            the connect-time exchange and its compatibility check
    validation.py           checks on every arriving tree (vectorised over the batch)
    request_validation.py   checks on every arriving update

This package imports nothing else from the repository (docs/architecture.md, "Layout").
"""

from outrider.proto.errors import HandshakeMismatchError, InvalidDraftError
from outrider.proto.handshake import (
    INCARNATION_METADATA,
    PROTOCOL_VERSION,
    STALE_INCARNATION,
    TARGET_METADATA,
    FeatureSpec,
    HandshakeRequest,
    HandshakeResponse,
    Limits,
    check_handshake,
    stale_incarnation,
    vocab_fingerprint,
)
from outrider.proto.messages import (
    DEFAULT_NUM_SPECULATIVE_TOKENS,
    DEFAULT_Q_WIDTH,
    DEFAULT_TREE_BUDGET,
    DraftRequest,
    SamplingParams,
    SequenceUpdate,
    TreeBudget,
    shared_budget,
)
from outrider.proto.request_validation import check_request, validate_update
from outrider.proto.tensor import (
    FEATURE_DTYPES,
    decode_tensor,
    encode_tensor,
    join_projection,
    projection_chunks,
    projection_sha256,
)
from outrider.proto.tree import CandidateTree, DraftResponse, DraftSampling
from outrider.proto.validation import PROB_TOLERANCE, check_trees, receive_trees, validate_tree

__all__ = [
    "INCARNATION_METADATA",
    "STALE_INCARNATION",
    "TARGET_METADATA",
    "stale_incarnation",
    "FEATURE_DTYPES",
    "PROB_TOLERANCE",
    "PROTOCOL_VERSION",
    "CandidateTree",
    "DraftRequest",
    "DraftResponse",
    "DraftSampling",
    "FeatureSpec",
    "HandshakeMismatchError",
    "HandshakeRequest",
    "HandshakeResponse",
    "InvalidDraftError",
    "Limits",
    "SamplingParams",
    "SequenceUpdate",
    "TreeBudget",
    "shared_budget",
    "DEFAULT_NUM_SPECULATIVE_TOKENS",
    "DEFAULT_Q_WIDTH",
    "DEFAULT_TREE_BUDGET",
    "check_handshake",
    "check_request",
    "check_trees",
    "decode_tensor",
    "encode_tensor",
    "join_projection",
    "projection_chunks",
    "projection_sha256",
    "receive_trees",
    "validate_tree",
    "validate_update",
    "vocab_fingerprint",
]
