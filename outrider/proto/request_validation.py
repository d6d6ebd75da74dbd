"""Validation of what the drafter receives: each round's batch of SequenceUpdates.

The target is the better-trusted side, but a drafter serves many targets and a bad update
(a budget past what was negotiated, features of the wrong width) would fail deep inside a
proposer. Checking at the door turns that into one error naming the sequence and field; the
drafter skips that sequence and the target, receiving no tree, decodes it without one.
"""

from __future__ import annotations

import math

import torch

from outrider.proto.errors import InvalidDraftError
from outrider.proto.handshake import FeatureSpec, Limits
from outrider.proto.messages import DraftRequest, SequenceUpdate


def validate_update(
    update: SequenceUpdate, *, vocab_size: int, limits: Limits, features: FeatureSpec
) -> None:
    """Raise InvalidDraftError unless `update` keeps the handshake's terms."""
    problem = _update_problem(update, vocab_size, limits, features)
    if problem is not None:
        raise InvalidDraftError(f"{_label(update)}: {problem}")


def check_request(
    request: DraftRequest, *, vocab_size: int, limits: Limits, features: FeatureSpec
) -> list[InvalidDraftError | None]:
    """For each update, None if it may be drafted for, else the error saying why.

    Updates past the negotiated max_batch, and repeats of a seq_id, are refused one by one so
    the rest of the batch is still served.
    """
    errors: list[InvalidDraftError | None] = []
    seen: set[int] = set()
    for index, update in enumerate(request.updates):
        if index >= limits.max_batch:
            problem: str | None = f"updates[{index}] is past the negotiated max_batch = {limits.max_batch}"
        elif update.seq_id in seen:
            problem = "a second update for the same seq_id in one request"
        else:
            problem = _update_problem(update, vocab_size, limits, features)
        seen.add(update.seq_id)
        errors.append(None if problem is None else InvalidDraftError(f"{_label(update)}: {problem}"))
    return errors


def _label(update: SequenceUpdate) -> str:
    return f"update seq_id={update.seq_id} round={update.round}"


def _update_problem(update: SequenceUpdate, vocab_size: int, limits: Limits, spec: FeatureSpec) -> str | None:
    tokens = update.new_tokens
    if not isinstance(tokens, torch.Tensor) or tokens.dtype != torch.int64 or tokens.dim() != 1:
        got = f"{tokens.dtype} of shape {list(tokens.shape)}" if isinstance(tokens, torch.Tensor) else tokens
        return f"new_tokens must be a 1-D torch.int64 tensor, got {got}"
    num_tokens = tokens.shape[0]
    if num_tokens == 0 and not update.finished:
        return "new_tokens is empty: every round commits at least one token (the next root)"
    out_of_vocab = (tokens < 0) | (tokens >= vocab_size)
    if bool(out_of_vocab.any()):
        index = int(out_of_vocab.nonzero()[0, 0])
        return f"new_tokens[{index}] = {int(tokens[index])} is outside the vocabulary [0, {vocab_size})"
    return (
        _budget_problem(update, limits)
        or _sampling_problem(update)
        or _processor_problem(update, vocab_size)
        or _feature_problem(update, spec)
    )


def _budget_problem(update: SequenceUpdate, limits: Limits) -> str | None:
    budget = update.budget
    for name, least, most in (
        ("max_nodes", 1, limits.max_nodes),
        ("max_depth", 0, limits.max_depth),
        ("top_k", 0, limits.max_top_k),
        ("q_width", 0, limits.max_q_width),
    ):
        value = getattr(budget, name)
        if not least <= value <= most:
            return f"budget.{name} = {value} is outside [{least}, {most}] (the negotiated limits)"
    return None


def _sampling_problem(update: SequenceUpdate) -> str | None:
    sampling = update.sampling
    # Written as "not (in range)" so NaN, which fails every comparison, is refused too.
    if not (math.isfinite(sampling.temperature) and sampling.temperature >= 0):
        return f"sampling.temperature = {sampling.temperature} must be finite and >= 0"
    if sampling.top_k < 0:
        return f"sampling.top_k = {sampling.top_k} must be >= 0 (0 disables it)"
    if not 0 < sampling.top_p <= 1:
        return f"sampling.top_p = {sampling.top_p} must be in (0, 1] (1 disables it)"
    if not 0 <= sampling.min_p <= 1:
        return f"sampling.min_p = {sampling.min_p} must be in [0, 1] (0 disables it)"
    if sampling.seed is not None and not 0 <= sampling.seed < 2**64:
        return f"sampling.seed = {sampling.seed} must fit in 64 unsigned bits"
    return None


def _processor_problem(update: SequenceUpdate, vocab_size: int) -> str | None:
    """Penalties finite (repetition > 0), logit_bias and stop ids in the vocabulary."""
    sampling = update.sampling
    for name in ("presence_penalty", "frequency_penalty"):
        if not math.isfinite(getattr(sampling, name)):
            return f"sampling.{name} = {getattr(sampling, name)} must be finite"
    if not (math.isfinite(sampling.repetition_penalty) and sampling.repetition_penalty > 0):
        return f"sampling.repetition_penalty = {sampling.repetition_penalty} must be finite and > 0"
    for token, bias in sampling.logit_bias:
        if not (0 <= token < vocab_size and math.isfinite(bias)):
            return (
                f"sampling.logit_bias entry ({token}, {bias}): the token must be in [0, {vocab_size}) and "
                "the bias finite (logit_bias_token_ids and logit_bias_values pair up one to one)"
            )
    if not all(0 <= t < vocab_size for t in sampling.stop_ids):
        return f"sampling.stop_ids must be in the vocabulary [0, {vocab_size})"
    return None


def _feature_problem(update: SequenceUpdate, spec: FeatureSpec) -> str | None:
    values = update.features
    num_tokens = update.new_tokens.shape[0]
    if values is None:
        if spec.needs_features and num_tokens > 0 and not update.finished:
            return f"features are missing: the drafter needs [{num_tokens}, {spec.width}] {spec.dtype} values"
        return None
    if not spec.needs_features:
        return f"features of shape {list(values.shape)} were sent, but the drafter asked for none"
    expected = (num_tokens, spec.width)
    if tuple(values.shape) != expected:
        return (
            f"features have shape {list(values.shape)}, expected [len(new_tokens), width] = {list(expected)}"
        )
    if str(values.dtype) != f"torch.{spec.dtype}":
        return f"features are {values.dtype}, but the handshake agreed on {spec.dtype}"
    return None
