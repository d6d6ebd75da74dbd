"""Target -> draft: the per-sequence delta sent every round, mirrored from `outrider.proto`.

Each round the target sends, per sequence, only what changed since the previous round: the
tokens committed since then (the last of them is the root of the next tree), their target
features when the drafter needs them, and what the drafter may propose (sampling params and
a tree budget). `reset` replaces the delta by the full context when the drafter must
re-sync (a new sequence, a drafter restart, a lost round).

`from_proto` decodes without judging; `proto.validation.validate_update` judges.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from outrider.proto import outrider_pb2 as pb
from outrider.proto.tensor import decode_tensor, encode_tensor, repeated_to_tensor


@dataclass(frozen=True)
class SamplingParams:
    """The target's sampling settings; the drafter applies the same ones to build q.

    Besides temperature/top-k/top-p/min-p, the processors that depend on the tokens so far
    (penalties, logit_bias, min_tokens: docs/algorithms.md section 2d), so a drafter can
    process each node's q with the tokens on its path as the target processes p."""

    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = disabled
    top_p: float = 1.0  # in (0, 1]; 1 = disabled
    min_p: float = 0.0  # in [0, 1]; 0 = disabled
    seed: int | None = None  # None = unseeded
    presence_penalty: float = 0.0  # 0 = off; counted over the output
    frequency_penalty: float = 0.0  # 0 = off; counted over the output
    repetition_penalty: float = 1.0  # 1 = off; every token of prompt + output
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)
    min_tokens: int = 0  # `stop_ids` masked while the output is shorter
    stop_ids: tuple[int, ...] = ()  # the sequence's EOS and stop_token_ids (with min_tokens only)
    num_prompt: int = 0  # context tokens before the output (the output is the rest)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @property
    def processes_logits(self) -> bool:
        """Whether any path-dependent processor applies to this sequence's q."""
        return self.penalized or bool(self.logit_bias) or bool(self.min_tokens and self.stop_ids)

    def to_proto(self) -> pb.SamplingParams:
        message = pb.SamplingParams(
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            min_p=self.min_p,
            seed=self.seed,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            logit_bias_token_ids=[t for t, _ in self.logit_bias],
            logit_bias_values=[b for _, b in self.logit_bias],
            min_tokens=self.min_tokens,
            stop_ids=self.stop_ids,
            num_prompt=self.num_prompt,
        )
        if self.repetition_penalty != 1.0:
            message.repetition_penalty = self.repetition_penalty
        return message

    @classmethod
    def from_proto(cls, message: pb.SamplingParams) -> SamplingParams:
        return cls(
            temperature=message.temperature,
            top_k=message.top_k,
            top_p=message.top_p,
            min_p=message.min_p,
            seed=message.seed if message.HasField("seed") else None,
            presence_penalty=message.presence_penalty,
            frequency_penalty=message.frequency_penalty,
            repetition_penalty=message.repetition_penalty if message.HasField("repetition_penalty") else 1.0,
            logit_bias=_pairs(list(message.logit_bias_token_ids), list(message.logit_bias_values)),
            min_tokens=message.min_tokens,
            stop_ids=tuple(message.stop_ids),
            num_prompt=message.num_prompt,
        )


def _pairs(ids: list[int], values: list[float]) -> tuple[tuple[int, float], ...]:
    """logit_bias pairs; lists of unequal length are padded (id -1, bias NaN) for validation to refuse."""
    n = max(len(ids), len(values))
    ids, values = ids + [-1] * (n - len(ids)), values + [float("nan")] * (n - len(values))
    return tuple(zip(ids, values, strict=True))


@dataclass(frozen=True)
class TreeBudget:
    """What one candidate tree may hold; always within the handshake's negotiated Limits."""

    max_nodes: int  # nodes in the tree, root included; 1 = no draft tokens
    max_depth: int  # draft tokens on any root-to-leaf path (the root is depth 0)
    top_k: int  # children per node
    q_width: int = 0  # the most entries a sparse q row may hold; given below top_k (0): top_k

    def __post_init__(self) -> None:
        # Stored resolved, so `q_width` is the one name for the row width (no "effective" twin).
        object.__setattr__(self, "q_width", max(self.top_k, self.q_width))

    def to_proto(self) -> pb.TreeBudget:
        return pb.TreeBudget(
            max_nodes=self.max_nodes, max_depth=self.max_depth, top_k=self.top_k, q_width=self.q_width
        )

    @classmethod
    def from_proto(cls, message: pb.TreeBudget) -> TreeBudget:
        return cls(
            max_nodes=message.max_nodes,
            max_depth=message.max_depth,
            top_k=message.top_k,
            q_width=message.q_width,
        )


@functools.lru_cache(maxsize=1024)
def shared_budget(max_nodes: int, max_depth: int, top_k: int, q_width: int = 0) -> TreeBudget:
    """The one `TreeBudget` of these values (frozen, so shareable): the engine and policy give
    every sequence one each round, and a dataclass built per sequence per round cost ~5 us."""
    return TreeBudget(max_nodes=max_nodes, max_depth=max_depth, top_k=top_k, q_width=q_width)


# The one place for the tree-budget defaults: the engine's per-round ceiling, the serving
# config's `tree_budget`, and K where a speculative config omits `num_speculative_tokens`.
DEFAULT_Q_WIDTH = (
    32  # entries per sampled q row (small family, T = 1: tau 1.25 at 1 entry, 1.88 at 16, 2.11 at 32)
)
DEFAULT_TREE_BUDGET = TreeBudget(max_nodes=32, max_depth=8, top_k=8, q_width=DEFAULT_Q_WIDTH)
DEFAULT_NUM_SPECULATIVE_TOKENS = 4


@dataclass
class SequenceUpdate:
    """One sequence's delta since the previous round (the whole context when `reset`)."""

    seq_id: int
    round: int  # the round whose tree the drafter should answer with
    new_tokens: torch.Tensor  # [num_new_tokens] int64; the last one is the next tree's root
    sampling: SamplingParams
    budget: TreeBudget
    # [num_new_tokens, feature_width] float32 | bfloat16 | float16; feature_width is
    # FeatureSpec.width from the handshake. None when the drafter needs no features.
    features: torch.Tensor | None = None
    finished: bool = False  # the drafter may free this sequence's state
    reset: bool = False  # new_tokens is the full context: drop cached state first
    answered: bool = False  # the target holds this round's tree already (a pushed guess came true)

    def to_proto(self) -> pb.SequenceUpdate:
        message = pb.SequenceUpdate(
            seq_id=self.seq_id,
            round=self.round,
            new_tokens=self.new_tokens.tolist(),
            sampling=self.sampling.to_proto(),
            budget=self.budget.to_proto(),
            finished=self.finished,
            reset=self.reset,
            answered=self.answered,
        )
        if self.features is not None:
            message.features.CopyFrom(encode_tensor(self.features))
        return message

    @classmethod
    def from_proto(cls, message: pb.SequenceUpdate, field: str = "update") -> SequenceUpdate:
        """InvalidDraftError if the feature bytes don't match their header."""
        features = None
        if message.HasField("features"):
            features = decode_tensor(message.features, f"{field}(seq_id={message.seq_id}).features")
        return cls(
            seq_id=message.seq_id,
            round=message.round,
            new_tokens=repeated_to_tensor(message.new_tokens, torch.int64),
            sampling=SamplingParams.from_proto(message.sampling),
            budget=TreeBudget.from_proto(message.budget),
            features=features,
            finished=message.finished,
            reset=message.reset,
            answered=message.answered,
        )

    @classmethod
    def make_dummy(
        cls,
        seq_id: int = 0,
        round: int = 0,
        num_new_tokens: int = 1,
        *,
        vocab_size: int = 32,
        feature_width: int = 0,
        feature_dtype: torch.dtype = torch.bfloat16,
        sampling: SamplingParams | None = None,
        budget: TreeBudget | None = None,
        seed: int = 0,
    ) -> SequenceUpdate:
        """A valid random update for tests; `feature_width` 0 means no features."""
        generator = torch.Generator().manual_seed(seed)
        tokens = torch.randint(vocab_size, (num_new_tokens,), generator=generator)
        features = None
        if feature_width:
            features = torch.randn(num_new_tokens, feature_width, generator=generator).to(feature_dtype)
        return cls(
            seq_id=seq_id,
            round=round,
            new_tokens=tokens,
            sampling=sampling or SamplingParams(temperature=1.0, top_k=20, top_p=0.9, seed=seed),
            budget=budget or TreeBudget(max_nodes=16, max_depth=4, top_k=4),
            features=features,
        )


@dataclass
class DraftRequest:
    """One round's batch of updates, at most Limits.max_batch, one per seq_id."""

    updates: list[SequenceUpdate] = field(default_factory=list)

    def to_proto(self) -> pb.DraftRequest:
        return pb.DraftRequest(updates=[update.to_proto() for update in self.updates])

    @classmethod
    def from_proto(cls, message: pb.DraftRequest) -> DraftRequest:
        return cls(
            updates=[
                SequenceUpdate.from_proto(update, f"updates[{i}]") for i, update in enumerate(message.updates)
            ]
        )
