"""Which draft worker drafts each sequence, and when that worker must be sent it whole.

Sticky routing: a sequence stays on its worker while that worker is up. When it must move,
the healthy worker with the highest rendezvous hash takes it; when a worker leaves, only its
own sequences move.

A draft worker keeps per-sequence state built from the deltas it was sent, so the client
keeps each live sequence's full context (and features, for EAGLE-style drafters) and sends
it whole (`reset=True`) whenever the worker cannot have it (a re-sync):

    the worker may have restarted       a stream was re-opened: the endpoint's generation moved
    the sequence moved                  its worker left, failed, or was removed from the pool
    the worker dropped it               several rounds in a row with no answer at all
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from outrider.proto import Limits, SequenceUpdate, TreeBudget
from outrider.target_worker.draft_client.transport import Endpoint


@dataclass
class SyncedSequence:
    """The client's copy of one live sequence, and where it is synced."""

    tokens: list[torch.Tensor]  # the full context, as the chunks it arrived in
    features: list[torch.Tensor] | None  # [n_i, width] chunks, when the drafter needs features
    endpoint: Endpoint | None = None  # where it is synced
    generation: int = -1  # that endpoint's stream generation when it was synced
    misses: int = 0  # consecutive rounds with no answer

    @classmethod
    def start(cls, update: SequenceUpdate) -> SyncedSequence:
        """From an update that carries the whole context (the first, or a reset)."""
        return cls([update.new_tokens], [update.features] if update.features is not None else None)

    def extend(self, update: SequenceUpdate) -> None:
        self.tokens.append(update.new_tokens)
        if self.features is not None and update.features is not None:
            self.features.append(update.features)

    def stale_on(self, endpoint: Endpoint) -> bool:
        """True if `endpoint` cannot hold this sequence: another worker, or a newer stream."""
        return self.endpoint is not endpoint or self.generation != endpoint.generation

    def in_sync(self) -> bool:
        return self.endpoint.healthy and self.generation == self.endpoint.generation

    def whole(self, update: SequenceUpdate) -> SequenceUpdate:
        """The update re-sent with the whole context (`reset=True`): a re-sync."""
        tokens = torch.cat(self.tokens)
        self.tokens = [tokens]
        features = None
        if self.features is not None:
            features = torch.cat(self.features)
            self.features = [features]
        return replace(update, new_tokens=tokens, features=features, reset=True)

    def synced_on(self, endpoint: Endpoint) -> None:
        self.endpoint, self.generation = endpoint, endpoint.generation

    def clear_misses(self) -> None:
        """The worker answered (in time or late): it clearly holds the sequence."""
        self.misses = 0

    def missed(self) -> None:
        self.misses += 1


def route(seq_id: int, current: Endpoint | None, endpoints: Sequence[Endpoint]) -> Endpoint | None:
    """Sticky: stay on the current worker while it is up; else the highest rendezvous hash."""
    if current is not None and current.healthy:
        return current
    healthy = [e for e in endpoints if e.healthy]
    if not healthy:
        return None
    return max(healthy, key=lambda e: rendezvous_weight(seq_id, e.address))


def rendezvous_weight(seq_id: int, address: str) -> int:
    """Highest-random-weight hashing: when a worker leaves, only its sequences move."""
    digest = hashlib.blake2b(f"{seq_id}@{address}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def fit_budget(budget: TreeBudget, limits: Limits) -> TreeBudget:
    """The engine's budget cut to what this worker negotiated (the worker refuses anything over)."""
    return TreeBudget(
        max_nodes=max(1, min(budget.max_nodes, limits.max_nodes)),
        max_depth=min(budget.max_depth, limits.max_depth),
        top_k=min(budget.top_k, limits.max_top_k),
        q_width=min(budget.q_width, limits.max_q_width),
    )
