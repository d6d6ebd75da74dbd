"""Draft -> target: candidate trees, mirrored from `outrider.proto`.

A candidate tree for a chain of 3 draft tokens and a tree with two branches:

    chain   node:    0   1   2   3          tree   node:    0   1   2   3   4
            parents: -1  0   1   2                  parents: -1  0   0   1   1
                     root -> 1 -> 2 -> 3                      root -> {1 -> {3, 4}, 2}

Node 0 is the root: the last committed token, whose target logits give the distribution of
its children. Every expanded node (one whose children were drawn from a draft distribution)
carries its sparse q as one row of top-k token ids and probabilities; the verifier
renormalises that row, so a drafter may send the top-k of a larger vocabulary.

`from_proto` raises InvalidDraftError only when a message cannot be represented at all
(ragged q rows, an unknown sampling mode); `proto.validation` judges the rest.
"""

from __future__ import annotations

import enum
import random
from dataclasses import dataclass, field

import torch

from outrider.proto import outrider_pb2 as pb
from outrider.proto.errors import InvalidDraftError
from outrider.proto.tensor import repeated_to_tensor


class DraftSampling(enum.IntEnum):
    """How the children of each expanded node were drawn: picks the verifier's residual rule."""

    DETERMINISTIC = 0  # top-k / argmax children (EAGLE-2/3, SGLang); q is not needed
    WITH_REPLACEMENT = 1  # children i.i.d. from q (SpecInfer)
    WITHOUT_REPLACEMENT = 2  # children from q without replacement (EAGLE-1, Sequoia)


# The wire enum reserves 0 for UNSPECIFIED, so a drafter that forgets the field is refused
# rather than silently verified as DETERMINISTIC.
_TO_WIRE = {
    DraftSampling.DETERMINISTIC: pb.DRAFT_SAMPLING_DETERMINISTIC,
    DraftSampling.WITH_REPLACEMENT: pb.DRAFT_SAMPLING_WITH_REPLACEMENT,
    DraftSampling.WITHOUT_REPLACEMENT: pb.DRAFT_SAMPLING_WITHOUT_REPLACEMENT,
}
_FROM_WIRE = {wire: mode for mode, wire in _TO_WIRE.items()}


def tree_label(seq_id: int, round: int) -> str:
    """How every error about a tree starts, so logs say which sequence and round it was."""
    return f"tree seq_id={seq_id} round={round}"


@dataclass
class CandidateTree:
    """One sequence's draft for one round; see the module docstring for the layout."""

    seq_id: int
    round: int
    tokens: torch.Tensor  # [num_nodes] int64; node 0 = root (the last committed token)
    parents: torch.Tensor  # [num_nodes] int64; parents[0] == -1, 0 <= parents[i] < i for i >= 1
    q_nodes: torch.Tensor  # [num_expanded] int64; nodes whose children were drawn from the q below
    q_token_ids: torch.Tensor  # [num_expanded, q_top_k] int64; -1 = padding
    q_probs: torch.Tensor  # [num_expanded, q_top_k] float32; 0 where padded
    sampling: DraftSampling

    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[0]

    def to_proto(self) -> pb.CandidateTree:
        return pb.CandidateTree(
            seq_id=self.seq_id,
            round=self.round,
            tokens=self.tokens.tolist(),
            parents=self.parents.tolist(),
            q_nodes=self.q_nodes.tolist(),
            q_top_k=self.q_token_ids.shape[1],
            q_token_ids=self.q_token_ids.reshape(-1).tolist(),
            q_probs=self.q_probs.reshape(-1).tolist(),
            sampling=_TO_WIRE[self.sampling],
        )

    @classmethod
    def from_proto(cls, message: pb.CandidateTree) -> CandidateTree:
        label = tree_label(message.seq_id, message.round)
        if message.sampling not in _FROM_WIRE:
            unspecified = message.sampling == pb.DRAFT_SAMPLING_UNSPECIFIED
            shown = "DRAFT_SAMPLING_UNSPECIFIED" if unspecified else str(message.sampling)
            raise InvalidDraftError(f"{label}: sampling = {shown} is not a draft sampling mode")
        num_expanded, width = len(message.q_nodes), message.q_top_k
        for name, values in (("q_token_ids", message.q_token_ids), ("q_probs", message.q_probs)):
            if len(values) != num_expanded * width:
                raise InvalidDraftError(
                    f"{label}: {name} has {len(values)} values, but len(q_nodes) * q_top_k = "
                    f"{num_expanded} * {width} = {num_expanded * width}"
                )
        return cls(
            seq_id=message.seq_id,
            round=message.round,
            tokens=repeated_to_tensor(message.tokens, torch.int64),
            parents=repeated_to_tensor(message.parents, torch.int64),
            q_nodes=repeated_to_tensor(message.q_nodes, torch.int64),
            q_token_ids=repeated_to_tensor(message.q_token_ids, torch.int64).reshape(num_expanded, width),
            q_probs=repeated_to_tensor(message.q_probs, torch.float32).reshape(num_expanded, width),
            sampling=_FROM_WIRE[message.sampling],
        )

    @classmethod
    def make_dummy(
        cls,
        num_nodes: int = 8,
        *,
        vocab_size: int = 32,
        top_k: int = 2,
        max_depth: int | None = None,
        sampling: DraftSampling = DraftSampling.WITHOUT_REPLACEMENT,
        seq_id: int = 0,
        round: int = 0,
        seed: int = 0,
    ) -> CandidateTree:
        """A valid random tree for tests: `top_k` = 1 gives a chain.

        Each new node hangs under a random node that still has room (fewer than `top_k`
        children, depth below `max_depth`). Every node with children gets a q row of `top_k`
        distinct tokens with positive probabilities summing to at most 1, and its children
        take distinct tokens from that row, so the tree is valid in every sampling mode.
        """
        if not 1 <= top_k <= vocab_size:
            raise ValueError(f"top_k = {top_k} must be in [1, vocab_size = {vocab_size}]")
        depth_cap = num_nodes if max_depth is None else max_depth
        rng = random.Random(seed)
        parents, depths, num_children = [-1], [0], [0]
        for node in range(1, num_nodes):
            room = [u for u in range(node) if num_children[u] < top_k and depths[u] < depth_cap]
            if not room:
                raise ValueError(f"{num_nodes} nodes do not fit in top_k = {top_k}, max_depth = {max_depth}")
            parent = rng.choice(room)
            parents.append(parent)
            depths.append(depths[parent] + 1)
            num_children[parent] += 1
            num_children.append(0)

        tokens = [rng.randrange(vocab_size)] + [0] * (num_nodes - 1)
        q_nodes = [u for u in range(num_nodes) if num_children[u] > 0]
        q_token_ids, q_probs = [], []
        for u in q_nodes:
            ids = rng.sample(range(vocab_size), top_k)
            weights = sorted((rng.uniform(0.1, 1.0) for _ in range(top_k)), reverse=True)
            mass = rng.uniform(0.5, 1.0)  # the rest of q lies outside the top-k
            q_token_ids.append(ids)
            q_probs.append([mass * w / sum(weights) for w in weights])
            children = [i for i in range(1, num_nodes) if parents[i] == u]
            for child, token in zip(children, ids[: len(children)], strict=True):
                tokens[child] = token
        return cls(
            seq_id=seq_id,
            round=round,
            tokens=torch.tensor(tokens, dtype=torch.int64),
            parents=torch.tensor(parents, dtype=torch.int64),
            q_nodes=torch.tensor(q_nodes, dtype=torch.int64),
            q_token_ids=torch.tensor(q_token_ids, dtype=torch.int64).reshape(len(q_nodes), top_k),
            q_probs=torch.tensor(q_probs, dtype=torch.float32).reshape(len(q_nodes), top_k),
            sampling=sampling,
        )


@dataclass
class DraftResponse:
    """A batch of candidate trees; a round's trees may arrive split over several responses."""

    trees: list[CandidateTree] = field(default_factory=list)

    def to_proto(self) -> pb.DraftResponse:
        return pb.DraftResponse(trees=[tree.to_proto() for tree in self.trees])

    @classmethod
    def from_proto(cls, message: pb.DraftResponse) -> DraftResponse:
        """All or nothing; `proto.validation.receive_trees` keeps the good trees of a batch."""
        return cls(trees=[CandidateTree.from_proto(tree) for tree in message.trees])
