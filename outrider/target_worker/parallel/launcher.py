"""Start N tensor-parallel rank processes on this machine (plain processes; Ray actors later).

    launch(my_rank_main, world_size=2, args=(checkpoint_path,))
    # runs my_rank_main(TPGroup(rank, 2), checkpoint_path) in each of 2 processes

Each rank joins a process group over TCP on localhost: NCCL when CUDA is available (rank r
uses GPU r), gloo otherwise, so CPU tests run the real sharded code path. An exception in any
rank is re-raised in the caller. `fn` must be importable (a module-level function).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from outrider.target_worker.parallel.group import TPGroup


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def launch(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple = (),
    backend: str | None = None,
    threads_per_rank: int = 1,
    timeout_s: float = 300.0,
) -> None:
    """Runs `fn(tp_group, *args)` in `world_size` processes and waits for all of them."""
    port = _free_port()
    mp.spawn(
        _rank_entry,
        args=(fn, world_size, backend or default_backend(), port, args, threads_per_rank, timeout_s),
        nprocs=world_size,
        join=True,
    )


def _rank_entry(
    rank: int,
    fn: Callable[..., Any],
    world_size: int,
    backend: str,
    port: int,
    args: tuple,
    threads_per_rank: int,
    timeout_s: float,
) -> None:
    # Ranks share the machine's cores; more threads per rank would oversubscribe them.
    torch.set_num_threads(threads_per_rank)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    try:
        fn(TPGroup(rank=rank, world_size=world_size), *args)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
