"""The draft registry's staleness rule, without Ray: the actor is this class behind `ray.remote`."""

from __future__ import annotations

from outrider.cluster.draft_registry import STALE_S, DraftRegistry
from outrider.cluster.messages import DraftAnnouncement


def test_fresh_lists_live_replicas_by_address_and_drops_silent_ones():
    now = [0.0]
    registry = DraftRegistry(clock=lambda: now[0])
    registry.announce(DraftAnnouncement("10.0.0.2:50051", "draft-b", trees_sent=1))
    registry.announce(DraftAnnouncement("10.0.0.1:50051", "draft-a"))
    assert [a.replica for a in registry.fresh()] == ["draft-a", "draft-b"]
    now[0] = STALE_S - 1
    registry.announce(DraftAnnouncement("10.0.0.2:50051", "draft-b", trees_sent=5))  # b's heartbeat
    now[0] = STALE_S + 1  # a stopped refreshing: dead
    (b,) = registry.fresh()
    assert (b.replica, b.trees_sent) == ("draft-b", 5)
    registry.withdraw("draft-b")  # a replica shutting down says so
    assert registry.fresh() == []
