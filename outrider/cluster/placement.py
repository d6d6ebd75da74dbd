"""Deployment options from the config: replicas or autoscaling, resources, placement groups.

Placement (docs/architecture.md, "Beyond one machine"): each target replica reserves one
bundle per tensor-parallel rank, packed on one node when it fits (else on as few nodes as
possible), on the large-GPU pool; each draft replica
one bundle on the small-GPU pool (`cluster.gpu_pools`). Without GPUs every ask is CPUs only.

Autoscaling, and the ratios to start from:

    target   Serve's default policy on requests in flight per replica; set
             target_ongoing_requests = engine.max_num_seqs so a replica is added when its batch
             is full and requests start to queue. upscale_delay_s ~5, downscale_delay_s ~60:
             a replica costs a model load, so shed it only after a quiet minute.
    draft    its own signal, `DraftLoadPolicy`: the share of time each draft replica spends
             drafting (its rounds never pass through Serve, so requests in flight is always 0).
             Aim for ~0.6 busy: above it rounds queue behind each other and miss the target's
             deadline. Start with 1 draft replica per 2-4 target replicas for model-based
             drafters on a small GPU (1 per 8+ for n-gram/suffix drafters, which are nearly free),
             max_replicas = target max_replicas.
"""

from __future__ import annotations

import math
from typing import Any

from outrider.cluster.config import AutoscalingArgs, OutriderArgs
from outrider.cluster.gpu_pools import (
    DRAFT_RESOURCE,
    TARGET_RESOURCE,
    GpuInfo,
    PoolAssignment,
    classify,
    gpu_inventory,
    placement_resources,
)

DRAFT_TARGET_BUSY = 0.6


class DraftLoadPolicy:
    """Serve custom autoscaling policy: replicas = total drafting load / target busy share."""

    def __init__(self, target_busy_fraction: float = DRAFT_TARGET_BUSY):
        self.target = target_busy_fraction

    def __call__(self, ctx) -> tuple[float, dict[str, Any]]:
        busy = (ctx.aggregated_metrics or {}).get("draft_busy_fraction", {})
        if not busy or ctx.current_num_replicas == 0:
            return ctx.target_num_replicas, {}
        load = sum(busy.values())  # replicas' worth of drafting work
        # Serve applies min/max replicas and the up/downscale delays around this.
        return max(1, math.ceil(load / self.target)), {"draft_load": load}


def _scaling(auto: AutoscalingArgs | None, replicas: int, policy: dict | None = None) -> dict[str, Any]:
    if auto is None:
        return {"num_replicas": replicas}
    config = auto.to_serve()
    if policy:
        config["policy"] = policy
    return {"autoscaling_config": config}


def target_options(args: OutriderArgs, pools: PoolAssignment) -> dict[str, Any]:
    tp = args.tensor_parallel_size
    gpu = placement_resources("target", pools, args.target.gpus_per_rank)
    per_rank = {"CPU": args.target.num_cpus, "GPU": gpu.get("num_gpus", 0), **gpu.get("resources", {})}
    per_rank = {k: v for k, v in per_rank.items() if v}
    options: dict[str, Any] = {
        # Serve's router queues no more than this per replica; beyond it: 429 at the ingress.
        "max_ongoing_requests": args.engine.max_num_seqs + args.engine.max_queued_requests,
        "max_queued_requests": args.engine.max_queued_requests,
        **_scaling(args.target.autoscaling, args.target.num_replicas),
    }
    if tp > 1:  # one bundle per rank; the replica itself takes bundle 0
        options["placement_group_bundles"] = [dict(per_rank) or {"CPU": 0.001} for _ in range(tp)]
        # PACK: one node whenever the group fits there (NVLink), else as few nodes as possible,
        # so a TP group larger than a node (DeepSeek-V3 on 2 x 8 GPUs) spans nodes (docs/deepseek.md).
        options["placement_group_strategy"] = "PACK"
        options["ray_actor_options"] = {"num_cpus": 0}
    else:
        options["ray_actor_options"] = {"num_cpus": args.target.num_cpus, **gpu}
    return options


def draft_options(args: OutriderArgs, pools: PoolAssignment) -> dict[str, Any]:
    gpu = placement_resources("draft", pools, args.draft_pool.gpus_per_replica)
    policy = {
        "policy_function": "outrider.cluster.placement:DraftLoadPolicy",
        "policy_kwargs": {"target_busy_fraction": args.draft_pool.target_busy_fraction},
    }
    return {
        "ray_actor_options": {"num_cpus": args.draft_pool.num_cpus, **gpu},
        **_scaling(args.draft_pool.autoscaling, args.draft_pool.num_replicas, policy),
    }


def cluster_pools(args: OutriderArgs, declared: dict[str, float] | None = None) -> PoolAssignment:
    """The GPU pools the Ray cluster declares, else this node's own (NVML).

    On a cluster (KubeRay) the app is built on whichever node Serve picks, often a head
    without GPUs; what counts is what the worker nodes declared with `ray start --resources`
    (the `outrider_*_gpu` resources), summed in `ray.cluster_resources()`. Only when no node
    declares a pool (one machine, `outrider serve`) is this node's NVML inventory classified.
    """
    if declared is None:
        import ray

        declared = ray.cluster_resources() if ray.is_initialized() else {}
    counts = {name: int(declared.get(name, 0)) for name in (DRAFT_RESOURCE, TARGET_RESOURCE)}
    if any(counts.values()):

        def pool(name: str) -> tuple[GpuInfo, ...]:
            return tuple(GpuInfo(i, "declared by the cluster", 0.0) for i in range(counts[name]))

        return PoolAssignment(draft=pool(DRAFT_RESOURCE), target=pool(TARGET_RESOURCE))
    return classify(gpu_inventory(), args.gpu_pools)
