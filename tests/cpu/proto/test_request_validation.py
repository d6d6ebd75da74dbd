"""Every arriving SequenceUpdate keeps the handshake's terms, or is refused with a precise reason."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from outrider.proto import (
    DraftRequest,
    FeatureSpec,
    InvalidDraftError,
    Limits,
    SamplingParams,
    SequenceUpdate,
    TreeBudget,
    check_request,
    validate_update,
)

VOCAB = 32
LIMITS = Limits(max_batch=3, max_nodes=16, max_depth=4, max_top_k=4)
FEATURES = FeatureSpec(layer_ids=(1, 2, 3), hidden_size=4, projected=False, dtype="bfloat16")  # width 12
NO_FEATURES = FeatureSpec()


def update(**changes: object) -> SequenceUpdate:
    base = SequenceUpdate.make_dummy(seq_id=5, round=2, num_new_tokens=3, vocab_size=VOCAB, feature_width=12)
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


def rejects(value: SequenceUpdate, match: str, features: FeatureSpec = FEATURES) -> None:
    with pytest.raises(InvalidDraftError, match=match) as caught:
        validate_update(value, vocab_size=VOCAB, limits=LIMITS, features=features)
    assert str(caught.value).startswith("update seq_id=5 round=2: ")


def test_accepts_update_with_features() -> None:
    validate_update(update(), vocab_size=VOCAB, limits=LIMITS, features=FEATURES)


def test_accepts_update_without_features_when_none_are_needed() -> None:
    validate_update(update(features=None), vocab_size=VOCAB, limits=LIMITS, features=NO_FEATURES)


def test_accepts_finished_update_without_tokens() -> None:
    empty = update(new_tokens=torch.zeros(0, dtype=torch.int64), features=None, finished=True)
    validate_update(empty, vocab_size=VOCAB, limits=LIMITS, features=FEATURES)


def test_rejects_out_of_vocab_token() -> None:
    rejects(
        update(new_tokens=torch.tensor([1, VOCAB, 2])),
        rf"new_tokens\[1\] = {VOCAB} is outside the vocabulary",
    )


def test_rejects_empty_round() -> None:
    rejects(update(new_tokens=torch.zeros(0, dtype=torch.int64), features=None), "new_tokens is empty")


def test_rejects_wrong_token_dtype() -> None:
    rejects(update(new_tokens=torch.tensor([1.0, 2.0, 3.0])), "new_tokens must be a 1-D torch.int64 tensor")


@pytest.mark.parametrize(
    ("budget", "match"),
    [
        (TreeBudget(max_nodes=17, max_depth=4, top_k=4), r"budget.max_nodes = 17 is outside \[1, 16\]"),
        (TreeBudget(max_nodes=0, max_depth=4, top_k=4), r"budget.max_nodes = 0 is outside \[1, 16\]"),
        (TreeBudget(max_nodes=16, max_depth=5, top_k=4), r"budget.max_depth = 5 is outside \[0, 4\]"),
        (TreeBudget(max_nodes=16, max_depth=4, top_k=5), r"budget.top_k = 5 is outside \[0, 4\]"),
        (TreeBudget(16, 4, 4, q_width=5), r"budget.q_width = 5 is outside \[0, 4\]"),
    ],
)
def test_rejects_budget_past_the_negotiated_limits(budget: TreeBudget, match: str) -> None:
    rejects(update(budget=budget), match)


@pytest.mark.parametrize(
    ("sampling", "match"),
    [
        (SamplingParams(temperature=-0.5), "temperature = -0.5 must be finite and >= 0"),
        (SamplingParams(temperature=math.nan), "temperature = nan must be finite"),
        (SamplingParams(temperature=math.inf), "temperature = inf must be finite"),
        (SamplingParams(top_k=-1), "top_k = -1 must be >= 0"),
        (SamplingParams(top_p=0.0), r"top_p = 0.0 must be in \(0, 1\]"),
        (SamplingParams(top_p=1.5), r"top_p = 1.5 must be in \(0, 1\]"),
        (SamplingParams(top_p=math.nan), r"top_p = nan must be in \(0, 1\]"),
        (SamplingParams(min_p=1.5), r"min_p = 1.5 must be in \[0, 1\]"),
    ],
)
def test_rejects_bad_sampling_params(sampling: SamplingParams, match: str) -> None:
    rejects(update(sampling=sampling), match)


def test_rejects_missing_features() -> None:
    rejects(update(features=None), r"features are missing: the drafter needs \[3, 12\] bfloat16 values")


def test_rejects_unrequested_features() -> None:
    rejects(update(), r"features of shape \[3, 12\] were sent, but the drafter asked for none", NO_FEATURES)


def test_rejects_features_of_the_wrong_shape() -> None:
    rejects(
        update(features=torch.zeros(3, 4, dtype=torch.bfloat16)),
        r"features have shape \[3, 4\], expected \[len\(new_tokens\), width\] = \[3, 12\]",
    )
    rejects(update(features=torch.zeros(2, 12, dtype=torch.bfloat16)), r"features have shape \[2, 12\]")


def test_rejects_features_of_the_wrong_dtype() -> None:
    rejects(
        update(features=torch.zeros(3, 12, dtype=torch.float16)),
        "features are torch.float16, but the handshake",
    )


def test_check_request_refuses_only_the_bad_updates() -> None:
    good = [update(seq_id=i) for i in range(3)]
    request = DraftRequest([good[0], update(seq_id=1, new_tokens=torch.tensor([1, 2, -3])), good[0], good[2]])
    errors = check_request(request, vocab_size=VOCAB, limits=LIMITS, features=FEATURES)
    assert errors[0] is None
    assert "new_tokens[2] = -3" in str(errors[1])
    assert "a second update for the same seq_id" in str(errors[2])
    assert "updates[3] is past the negotiated max_batch = 3" in str(errors[3])
