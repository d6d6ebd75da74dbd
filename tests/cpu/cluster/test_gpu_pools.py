"""GPU pool classification and placement, with a fake NVML inventory (no GPU here)."""

from __future__ import annotations

import pytest

from outrider.cluster.gpu_pools import (
    DRAFT_RESOURCE,
    TARGET_RESOURCE,
    GpuInfo,
    GpuPoolConfig,
    classify,
    gpu_inventory,
    placement_resources,
)

L4 = GpuInfo(0, "NVIDIA L4", 22.5)
A100_40 = GpuInfo(1, "NVIDIA A100-SXM4-40GB", 39.4)
H100 = GpuInfo(2, "NVIDIA H100 80GB HBM3", 79.6)


def test_small_gpus_draft_large_gpus_verify_mid_size_serve_both():
    pools = classify([L4, A100_40, H100])
    assert pools.draft == (L4, A100_40) and pools.target == (A100_40, H100)
    assert pools.ray_resources() == {DRAFT_RESOURCE: 2.0, TARGET_RESOURCE: 2.0}


def test_thresholds_are_configurable():
    pools = classify([L4, A100_40, H100], GpuPoolConfig(draft_max_memory_gib=40, target_min_memory_gib=60))
    assert pools.draft == (L4, A100_40) and pools.target == (H100,)


def test_placement_asks_for_the_pool_resource():
    pools = classify([L4, H100])
    assert placement_resources("target", pools) == {"num_gpus": 1.0, "resources": {TARGET_RESOURCE: 1.0}}
    assert placement_resources("draft", pools, 0.5) == {"num_gpus": 0.5, "resources": {DRAFT_RESOURCE: 0.5}}
    with pytest.raises(ValueError, match="role"):
        placement_resources("verifier", pools)


def test_no_gpus_falls_back_to_cpu_placement():
    def no_driver():
        raise OSError("NVML Shared Library Not Found")

    gpus = gpu_inventory(no_driver)
    assert gpus == []
    pools = classify(gpus)
    assert pools.ray_resources() == {}
    assert placement_resources("target", pools) == {"num_gpus": 0}
    assert placement_resources("draft", pools) == {"num_gpus": 0}


def test_real_probe_on_this_machine_does_not_raise():
    # CPU machines have no NVML driver: the inventory is empty, never an exception.
    assert isinstance(gpu_inventory(), list)


def test_the_cluster_declared_pools_win_over_the_building_node(monkeypatch):
    """Under KubeRay the app may be built on a GPU-less head: pools come from what the worker
    groups declared (`rayStartParams.resources`), not from the building node's NVML."""
    import outrider.cluster.placement as placement
    from outrider.cluster.config import OutriderArgs
    from outrider.cluster.gpu_pools import DRAFT_RESOURCE, TARGET_RESOURCE

    monkeypatch.setattr(placement, "gpu_inventory", lambda: [])  # the head sees no GPU
    args = OutriderArgs()
    pools = placement.cluster_pools(args, declared={"CPU": 8.0, TARGET_RESOURCE: 16.0, DRAFT_RESOURCE: 4.0})
    assert (len(pools.target), len(pools.draft)) == (16, 4)
    assert placement.target_options(args, pools)["ray_actor_options"]["resources"] == {TARGET_RESOURCE: 1.0}
    assert placement.cluster_pools(args, declared={"CPU": 8.0}).ray_resources() == {}  # CPU fallback
