"""The handshake refuses a mismatched draft/target pair and lists every reason at once."""

from __future__ import annotations

import dataclasses
import hashlib

import pytest

from outrider.proto import (
    PROTOCOL_VERSION,
    FeatureSpec,
    HandshakeMismatchError,
    HandshakeRequest,
    HandshakeResponse,
    Limits,
    check_handshake,
    vocab_fingerprint,
)

VOCAB = {"<s>": 0, "a": 1, "b": 2, "ab": 3, "é": 4}
FINGERPRINT = vocab_fingerprint(VOCAB)
EAGLE3_FEATURES = FeatureSpec(layer_ids=(2, 16, 29), hidden_size=64, projected=True, dtype="bfloat16")


def target(**changes: object) -> HandshakeRequest:
    request = HandshakeRequest(
        target_model_id="outrider-demo-small",
        vocab_size=len(VOCAB),
        vocab_fingerprint=FINGERPRINT,
        target_num_layers=32,
        target_hidden_size=64,
        limits=Limits(max_batch=64, max_nodes=64, max_depth=8, max_top_k=10),
        method="eagle3",
    )
    return dataclasses.replace(request, **changes)  # type: ignore[arg-type]


def draft(**changes: object) -> HandshakeResponse:
    response = HandshakeResponse(
        draft_model_id="outrider-demo-small-eagle3",
        vocab_size=len(VOCAB),
        vocab_fingerprint=FINGERPRINT,
        method="eagle3",
        limits=Limits(max_batch=32, max_nodes=128, max_depth=6, max_top_k=16),
        features=EAGLE3_FEATURES,
        target_model_id="outrider-demo-small",
        projection_sha256="5e" * 32,
    )
    return dataclasses.replace(response, **changes)  # type: ignore[arg-type]


def mismatches(request: HandshakeRequest, response: HandshakeResponse) -> list[str]:
    with pytest.raises(HandshakeMismatchError) as caught:
        check_handshake(request, response)
    assert str(caught.value).startswith(
        f"draft/target handshake refused ({len(caught.value.mismatches)} mismatches)"
    )
    return caught.value.mismatches


def test_fingerprint_ignores_dict_order() -> None:
    assert vocab_fingerprint(dict(reversed(list(VOCAB.items())))) == FINGERPRINT
    assert len(FINGERPRINT) == 64 and int(FINGERPRINT, 16) >= 0


def test_fingerprint_is_pinned() -> None:
    # The encoding is part of the contract: sha256 of the compact UTF-8 JSON of the sorted
    # [token, id] pairs. Peers built apart (another language, another tokenizer library) must agree.
    assert vocab_fingerprint({"b": 1, "a": 0}) == hashlib.sha256(b'[["a",0],["b",1]]').hexdigest()
    assert vocab_fingerprint({"é": 0}) == hashlib.sha256('[["é",0]]'.encode()).hexdigest()


def test_fingerprint_changes_with_any_token_or_id() -> None:
    assert vocab_fingerprint({**VOCAB, "ab": 5}) != FINGERPRINT
    assert vocab_fingerprint({**VOCAB, "ba": 5}) != FINGERPRINT
    renamed = {("c" if token == "b" else token): i for token, i in VOCAB.items()}
    assert vocab_fingerprint(renamed) != FINGERPRINT


def test_compatible_pair_negotiates_the_smaller_limits() -> None:
    assert check_handshake(target(), draft()) == Limits(
        max_batch=32, max_nodes=64, max_depth=6, max_top_k=10, max_q_width=10
    )
    wide = draft(limits=Limits(max_batch=32, max_nodes=128, max_depth=6, max_top_k=16, max_q_width=32))
    assert check_handshake(target(limits=Limits(64, 64, 8, 4, 16)), wide).max_q_width == 16


def test_empty_method_and_target_id_accept_any() -> None:
    check_handshake(target(method=""), draft(target_model_id="", method="ngram", features=FeatureSpec()))


def test_rejects_other_vocabulary() -> None:
    (reason,) = mismatches(target(), draft(vocab_fingerprint=vocab_fingerprint({"x": 0})))
    assert reason.startswith("vocab_fingerprint: target") and "tokenizers differ" in reason


def test_rejects_other_vocab_size() -> None:
    assert mismatches(target(), draft(vocab_size=6)) == ["vocab_size: target 5, draft 6"]


def test_rejects_drafter_built_for_another_target() -> None:
    (reason,) = mismatches(target(), draft(target_model_id="llama-3.1-8b"))
    assert "built for 'llama-3.1-8b'" in reason and "serves 'outrider-demo-small'" in reason


def test_rejects_other_method() -> None:
    assert mismatches(target(), draft(method="medusa")) == [
        "method: the target expects 'eagle3', the drafter runs 'medusa'"
    ]


def test_rejects_other_protocol_version() -> None:
    (reason,) = mismatches(target(), draft(protocol_version=2))
    assert reason == f"protocol_version: draft speaks 2, this build speaks {PROTOCOL_VERSION}"


def test_rejects_feature_needs_the_target_cannot_meet() -> None:
    features = FeatureSpec(layer_ids=(2, 2, 40), hidden_size=128, dtype="float64")
    reasons = mismatches(target(), draft(features=features))
    assert len(reasons) == 4, reasons
    assert "layers [40] do not exist in the target's 32 layers" in reasons[0]
    assert "names a layer twice" in reasons[1]
    assert "expects 128, the target's hidden size is 64" in reasons[2]
    assert "'float64' is not one of" in reasons[3]


def test_layer_num_layers_is_the_final_hidden_state() -> None:
    final = FeatureSpec(layer_ids=(32,), hidden_size=64, dtype="bfloat16")  # Medusa, MTP
    check_handshake(target(), draft(features=final, projection_sha256=""))
    (reason,) = mismatches(target(), draft(features=FeatureSpec(layer_ids=(33,), hidden_size=64)))
    assert "layers [33] do not exist in the target's 32 layers (layer 32 = the final hidden state)" in reason


def test_rejects_projected_features_without_a_published_projection() -> None:
    (reason,) = mismatches(target(), draft(projection_sha256=""))
    assert reason == (
        "features.projected: the drafter asks for projected features but publishes no projection"
    )


def test_rejects_limits_that_leave_nothing_to_draft() -> None:
    (reason,) = mismatches(
        target(), draft(limits=Limits(max_batch=32, max_nodes=1, max_depth=6, max_top_k=16))
    )
    assert reason == "limits.max_nodes: negotiated 1 (target 64, draft 1), below the 2 any draft needs"


def test_lists_every_mismatch_at_once() -> None:
    response = draft(vocab_size=6, vocab_fingerprint="0" * 64, method="ngram", target_model_id="other")
    reasons = mismatches(target(), response)
    assert [reason.split(":")[0] for reason in reasons] == [
        "vocab_size",
        "vocab_fingerprint",
        "target_model_id",
        "method",
    ]


def test_feature_width() -> None:
    assert EAGLE3_FEATURES.width == 64
    assert dataclasses.replace(EAGLE3_FEATURES, projected=False).width == 3 * 64
    assert FeatureSpec().width == 0 and not FeatureSpec().needs_features
