"""Run a function on N local processes over gloo: for tests, benchmarks and CPU runs."""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, threads, fn, args):
    torch.set_num_threads(threads)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=300),
    )
    try:
        fn(*args)
    finally:
        dist.destroy_process_group()


def spawn_local(fn, world_size: int, *args, threads: int | None = None) -> None:
    """Call ``fn(*args)`` on ``world_size`` fresh processes joined in a gloo process group.

    ``fn`` must be importable (module level). A failure on any rank raises here with the
    rank's traceback. ``threads`` is torch's intra-op threads per process (default: the
    CPU count shared evenly, at least 1).
    """
    if threads is None:
        threads = max(1, (os.cpu_count() or 1) // world_size)
    mp.start_processes(
        _worker,
        args=(world_size, free_port(), threads, fn, args),
        nprocs=world_size,
        join=True,
        start_method="spawn",
    )
