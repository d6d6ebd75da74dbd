"""Where the engine gets candidate trees from: the draft-source interface.

The engine is *handed* a draft source by whoever builds it (docs/architecture.md, "Layout"); it never
imports `draft_worker`. Two implementations exist: `InProcessDraftSource` (a proposer in the
same process, below) and the gRPC client (`outrider/target_worker/draft_client/`, the
disaggregation issue). One round, seen from the engine:

    source.submit(updates)          # right after commit: deltas for the sequences still running
    ...                             # engine work that overlaps drafting (stream outputs, admit, prefill)
    trees = source.collect(seq_ids, timeout_s)   # seq_id -> CandidateTree; absent = no tree this round

A sequence without a tree simply decodes one token that round: a slow, dead or malicious
drafter costs speed, never correctness or a request. Trees are untrusted: the engine checks
each against its budget, the vocabulary and its root before use.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import replace
from typing import Protocol

import torch

from outrider.proto import CandidateTree, FeatureSpec, SequenceUpdate


def project_features(features: torch.Tensor, projection: torch.Tensor) -> torch.Tensor:
    """Raw [n, len(layer_ids) * H] features through the drafter's fc [H, len(layer_ids) * H].

    Computed in float32 and returned in the features' dtype: the H values that cross the wire
    instead of 3H (EAGLE-3), exactly what the drafter's own fc would have made of them.
    """
    if features.shape[-1] != projection.shape[1]:
        raise ValueError(
            f"features of width {features.shape[-1]} cannot go through a projection of shape "
            f"{tuple(projection.shape)}"
        )
    projected = features.to(torch.float32) @ projection.to(device=features.device, dtype=torch.float32).T
    return projected.to(features.dtype)


def projected_update(update: SequenceUpdate, projection: torch.Tensor | None) -> SequenceUpdate:
    """The update with its raw features projected; unchanged when it carries none."""
    if update.features is None:
        return update
    if projection is None:
        raise ValueError("projected features need the drafter's projection, which is not known yet")
    return replace(update, features=project_features(update.features, projection))


class DraftSource(abc.ABC):
    # True: `collect` returns only trees already checked with `proto.check_trees` against the
    # budgets they were asked with (the gRPC client checks on its receiving thread), so the
    # engine does not check them twice. Sources returning unchecked trees leave it False.
    validates_trees: bool = False
    # True: drafting happens elsewhere between `submit` and `collect` (a draft worker over
    # gRPC), so the engine has work to overlap with it (`Engine` lanes). In-process sources
    # draft inside `collect`, on the engine's own thread, and leave it False.
    overlaps_drafting: bool = False
    # True: the q each tree carries may be used in the acceptance test (`draft_trust`), which is
    # lossless only if the children really were drawn from it. The operator's decision, never the
    # drafter's: in-process proposers are trusted, remote ones only when configured so. Untrusted
    # trees are verified as deterministic proposals, lossless whatever they hold.
    trusts_q: bool = False

    @property
    @abc.abstractmethod
    def feature_spec(self) -> FeatureSpec:
        """Which target features each update must carry (nothing, last hidden state, fused layers)."""

    @abc.abstractmethod
    def submit(self, updates: Sequence[SequenceUpdate]) -> None:
        """Hand over this round's deltas; returns without waiting for trees."""

    @abc.abstractmethod
    def collect(self, seq_ids: Sequence[int], timeout_s: float | None = None) -> dict[int, CandidateTree]:
        """Trees for the submitted sequences that are ready within `timeout_s` (None: wait for all)."""

    @property
    def label(self) -> str:
        """How logs name this source."""
        return type(self).__name__

    def close(self) -> None:  # noqa: B027 - optional hook: in-process sources hold nothing to release
        """Release connections and state."""

    def feature_projection(self) -> torch.Tensor | None:
        """The drafter's fc [H, len(layer_ids) * H] when `feature_spec.projected`; else None.

        The engine always hands over raw features; a source whose spec is projected applies
        this before they leave (`projected_update`), so only H values per token travel.
        """
        return None


class TreeProposer(Protocol):
    """What `InProcessDraftSource` needs: `draft_worker.proposer.Proposer` satisfies it."""

    @property
    def feature_spec(self) -> FeatureSpec: ...

    def propose(self, updates: Sequence[SequenceUpdate]) -> list[CandidateTree]: ...

    def feature_projection(self) -> torch.Tensor | None: ...


class InProcessDraftSource(DraftSource):
    """A proposer running in the engine's own process; drafting happens inside `collect`."""

    trusts_q = True  # our own code, in our own process

    def __init__(self, proposer: TreeProposer):
        self.proposer = proposer
        self._pending: list[SequenceUpdate] = []

    @property
    def feature_spec(self) -> FeatureSpec:
        return self.proposer.feature_spec

    def feature_projection(self) -> torch.Tensor | None:
        return self.proposer.feature_projection() if self.feature_spec.projected else None

    def submit(self, updates: Sequence[SequenceUpdate]) -> None:
        if self.feature_spec.projected:
            projection = self.feature_projection()
            updates = [projected_update(update, projection) for update in updates]
        self._pending.extend(updates)

    def collect(self, seq_ids: Sequence[int], timeout_s: float | None = None) -> dict[int, CandidateTree]:
        updates, self._pending = self._pending, []
        if not updates:
            return {}
        trees = self.proposer.propose(updates)
        wanted = set(seq_ids)
        return {tree.seq_id: tree for tree in trees if tree.seq_id in wanted}
