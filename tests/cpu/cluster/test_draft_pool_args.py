"""`draft_pool.shared_app`: an application drafting with another application's draft deployment."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from outrider.cluster.config import DraftPoolArgs, OutriderArgs
from outrider.cluster.gpu_pools import PoolAssignment
from outrider.cluster.placement import draft_options


def test_shared_app_means_mode_shared_and_trusted_like_the_owner():
    pool = DraftPoolArgs(shared_app="owner")
    assert pool.mode == "shared" and pool.trusts_drafts
    with pytest.raises(ValidationError, match="shared_app"):
        DraftPoolArgs(mode="shared")
    with pytest.raises(ValidationError, match="exclude each other"):
        DraftPoolArgs(shared_app="owner", draft_endpoints=["host:1"])


def test_the_draft_policy_aims_at_the_configured_busy_share():
    args = OutriderArgs(draft_pool={"mode": "deployment", "autoscaling": {}, "target_busy_fraction": 0.3})
    options = draft_options(args, PoolAssignment(draft=(), target=()))
    assert options["autoscaling_config"]["policy"]["policy_kwargs"] == {"target_busy_fraction": 0.3}


def test_draft_replicas_are_sized_for_every_sequence_the_targets_run():
    """A draft replica holds drafting state (a model drafter's KV cache) for every sequence the
    targets can run at once: at a fixed 32, a draft model at concurrency 64 drafted nothing for
    a third of the sequences it was asked for."""
    from outrider.cluster.app import draft_capacity

    assert draft_capacity(OutriderArgs()) == 32  # max_num_seqs 16, one target replica: the floor
    args = OutriderArgs(engine={"max_num_seqs": 64}, target={"num_replicas": 3})
    assert draft_capacity(args) == 192
    args = OutriderArgs(engine={"max_num_seqs": 64}, target={"autoscaling": {"max_replicas": 5}})
    assert draft_capacity(args) == 320
    args = OutriderArgs(engine={"max_num_seqs": 64}, draft_pool={"mode": "deployment", "max_sequences": 40})
    assert draft_capacity(args) == 40
    with pytest.raises(ValidationError, match="max_sequences"):
        DraftPoolArgs(max_sequences=0)
