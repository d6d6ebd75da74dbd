"""GPU pools: which GPUs of a node draft, which verify, as Ray custom resources.

Draft workers want many cheap GPUs, target workers few large ones (docs/architecture.md). The node's
inventory comes from nvidia-ml-py (NVML); each GPU is classified by its memory:

    memory <= draft_max_memory_gib                       -> draft pool   (e.g. L4 24 GiB, A10 24 GiB)
    memory >= target_min_memory_gib                      -> target pool  (e.g. H100 80 GiB, H200 141 GiB)
    in between                                           -> both pools   (e.g. A100 40GB: 39.4 GiB)

and the pools become Ray custom resources, one unit per GPU: `outrider_draft_gpu` and
`outrider_target_gpu`. Deployments ask for them beside `num_gpus`, so Ray places target
replicas only on large-GPU nodes and draft replicas only on small-GPU ones. On KubeRay the same
names go into each worker group's `rayStartParams.resources` (see k8s/).

On a machine without NVIDIA GPUs (or without the driver) the inventory is empty, no pool
resources are declared, and deployments fall back to CPU placement: no error, one log line.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass

from pydantic import BaseModel, Field

DRAFT_RESOURCE = "outrider_draft_gpu"
TARGET_RESOURCE = "outrider_target_gpu"

logger = logging.getLogger(__name__)


class GpuPoolConfig(BaseModel):
    """Memory thresholds that sort a node's GPUs into the draft and target pools."""

    draft_max_memory_gib: float = Field(
        32.0, gt=0, description="GPUs with at most this much memory (GiB) join the draft pool."
    )
    target_min_memory_gib: float = Field(
        40.0, gt=0, description="GPUs with at least this much memory (GiB) join the target pool."
    )


@dataclass(frozen=True)
class GpuInfo:
    index: int
    name: str
    memory_gib: float


def _nvml_inventory() -> list[GpuInfo]:
    import pynvml

    pynvml.nvmlInit()
    try:
        gpus = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            name = pynvml.nvmlDeviceGetName(handle)
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle).total
            gpus.append(GpuInfo(index, name.decode() if isinstance(name, bytes) else name, memory / 2**30))
        return gpus
    finally:
        pynvml.nvmlShutdown()


def gpu_inventory(probe: Callable[[], list[GpuInfo]] = _nvml_inventory) -> list[GpuInfo]:
    """This node's NVIDIA GPUs; empty where there are none or NVML is unavailable."""
    try:
        return probe()
    except Exception as e:  # NVMLError_LibraryNotFound, _DriverNotLoaded, ... : no usable GPUs
        logger.info("no NVIDIA GPUs visible (%s: %s); placing on CPUs", type(e).__name__, e)
        return []


@dataclass(frozen=True)
class PoolAssignment:
    draft: tuple[GpuInfo, ...]
    target: tuple[GpuInfo, ...]

    def ray_resources(self) -> dict[str, float]:
        """Custom resources for `ray.init(resources=...)` / `ray start --resources`; empty without GPUs."""
        resources = {}
        if self.draft:
            resources[DRAFT_RESOURCE] = float(len(self.draft))
        if self.target:
            resources[TARGET_RESOURCE] = float(len(self.target))
        return resources

    def ray_start_resources_flag(self) -> str:
        """The same, as `ray start --resources='<json>'` wants it."""
        return json.dumps(self.ray_resources(), sort_keys=True)


def classify(gpus: list[GpuInfo], config: GpuPoolConfig | None = None) -> PoolAssignment:
    """Sort GPUs into pools; a GPU between the thresholds (or in both, if they overlap) serves both."""
    config = config or GpuPoolConfig()
    draft = tuple(g for g in gpus if g.memory_gib <= config.draft_max_memory_gib or _between(g, config))
    target = tuple(g for g in gpus if g.memory_gib >= config.target_min_memory_gib or _between(g, config))
    return PoolAssignment(draft=draft, target=target)


def _between(gpu: GpuInfo, config: GpuPoolConfig) -> bool:
    return config.draft_max_memory_gib < gpu.memory_gib < config.target_min_memory_gib


def placement_resources(role: str, assignment: PoolAssignment, gpus_per_replica: float = 1.0) -> dict:
    """Ray actor options for a deployment of `role` ("draft" or "target") on this pool layout.

    With a GPU pool of that role: one unit of the pool resource and `num_gpus` per GPU used.
    Without one (a CPU machine): no GPU asks at all, so the replica runs on CPUs.
    """
    if role not in ("draft", "target"):
        raise ValueError(f"role must be 'draft' or 'target', got {role!r}")
    pool = assignment.draft if role == "draft" else assignment.target
    if not pool:
        return {"num_gpus": 0}
    resource = DRAFT_RESOURCE if role == "draft" else TARGET_RESOURCE
    return {"num_gpus": gpus_per_replica, "resources": {resource: gpus_per_replica}}
