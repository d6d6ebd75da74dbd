"""A target replica's tensor-parallel group: rank 0 in the replica, ranks 1.. as shard actors.

    placement group of one target replica (PACK: one node when the group fits, else spanning nodes)
      bundle 0: the TargetWorker replica  = rank 0: engine + LeaderRunner
      bundle 1: TPShard actor             = rank 1: follow(runner)     ...

Serve creates the placement group from the deployment's `placement_group_bundles`; the
replica places its shard actors in the other bundles, and all ranks join one
torch.distributed group over TCP (gloo on CPU, NCCL on GPU). Rank 0 then mirrors each
step's batch and cache operations to the others by broadcast
(`target_worker.parallel.batch_broadcast`), so the engine above sees a single runner.
"""

from __future__ import annotations

import logging
import socket
from datetime import timedelta

import ray
from ray.util.placement_group import get_current_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from outrider.cluster.served_model import ServedModel

log = logging.getLogger(__name__)


def default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _join(rank: int, world_size: int, address: str, timeout_s: float = 300.0):
    import torch.distributed as dist

    from outrider.target_worker.parallel import TPGroup
    from outrider.target_worker.parallel.launcher import default_backend

    dist.init_process_group(
        default_backend(),
        init_method=f"tcp://{address}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    return TPGroup(rank=rank, world_size=world_size)


def _load(model: ServedModel, tp, rows: int):
    from outrider.target_worker.runner import ModelRunner

    return ModelRunner.from_pretrained(
        model.target_dir,
        max_model_len=model.max_model_len,
        kv_cache_rows=rows,
        device=default_device(),
        tp=tp,
    )


@ray.remote
class TPShard:
    """Rank r >= 1: loads its shard, then replays rank 0's operations until told to stop."""

    def join(self, rank: int, world_size: int, address: str, model: ServedModel, rows: int) -> None:
        import torch

        torch.set_num_threads(1)  # ranks share the node's cores with rank 0
        self.tp = _join(rank, world_size, address)
        self.runner = _load(model, self.tp, rows)

    def follow(self) -> int:
        import torch.distributed as dist

        from outrider.target_worker.parallel.batch_broadcast import BatchBroadcaster, follow

        try:
            return follow(self.runner, BatchBroadcaster(self.tp, self.runner.device))
        finally:
            dist.destroy_process_group()


class TPShards:
    def __init__(self, model: ServedModel, world_size: int, rows: int, gpus_per_rank: float = 0.0):
        pg = get_current_placement_group()
        if pg is None:
            raise RuntimeError("a TP target replica needs placement_group_bundles (one per rank)")
        address = f"{ray.util.get_node_ip_address()}:{_free_port()}"
        self.actors = [
            TPShard.options(
                num_cpus=0,
                num_gpus=gpus_per_rank,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=pg, placement_group_bundle_index=rank
                ),
            ).remote()
            for rank in range(1, world_size)
        ]
        # Every rank blocks in init_process_group until all have joined: start theirs first.
        joined = [a.join.remote(r, world_size, address, model, rows) for r, a in enumerate(self.actors, 1)]
        self.tp = _join(0, world_size, address)
        self.runner = _load(model, self.tp, rows)
        ray.get(joined)
        self.following = [a.follow.remote() for a in self.actors]
        log.info("tensor-parallel group of %d ranks ready (rendezvous %s)", world_size, address)

    def leader_runner(self):
        from outrider.target_worker.parallel.batch_broadcast import BatchBroadcaster, LeaderRunner

        self.leader = LeaderRunner(self.runner, BatchBroadcaster(self.tp, self.runner.device))
        return self.leader

    def shutdown(self) -> None:
        try:
            self.leader.stop_followers()
            ray.get(self.following, timeout=10)
        except Exception as e:  # a dead shard: kill below regardless
            log.warning("tensor-parallel shards did not stop cleanly: %s", e)
        for actor in self.actors:
            ray.kill(actor)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]
