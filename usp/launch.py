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
        dist.barrier()  # nobody tears down gloo while a peer still talks to it
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


def _first_slurm_host(nodelist: str) -> str:
    """'gpu[012-015,020],cpu01' -> 'gpu012' (the first host of a Slurm node list)."""
    first = nodelist.split(",")[0]  # 'gpu[012-015' or 'cpu01'
    if "[" not in first:
        return first
    prefix, ranges = first.split("[", 1)
    return prefix + ranges.split("-")[0].rstrip("]")


def launcher_env(env=None) -> dict | None:
    """Rank/world/master from torchrun or Slurm variables, or None for a plain local launch."""
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:  # torchrun (also sets MASTER_ADDR/PORT)
        return {"kind": "torchrun", "rank": int(env["RANK"]), "world": int(env["WORLD_SIZE"]),
                "local_rank": int(env.get("LOCAL_RANK", 0)),
                "master_addr": env.get("MASTER_ADDR", "127.0.0.1"),
                "master_port": int(env.get("MASTER_PORT", 29500))}
    if "SLURM_PROCID" in env and int(env.get("SLURM_NTASKS", "1")) > 1:  # srun / submitit
        nodelist = env.get("SLURM_JOB_NODELIST", env.get("SLURM_NODELIST", "127.0.0.1"))
        return {"kind": "slurm", "rank": int(env["SLURM_PROCID"]),
                "world": int(env["SLURM_NTASKS"]), "local_rank": int(env.get("SLURM_LOCALID", 0)),
                "master_addr": env.get("MASTER_ADDR", _first_slurm_host(nodelist)),
                "master_port": int(env.get("MASTER_PORT", 29500))}
    return None


def init_from_env(info: dict, device: str = "auto") -> torch.device:
    """Join the process group described by ``launcher_env``; NCCL + CUDA when available."""
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if use_cuda:
        torch.cuda.set_device(info["local_rank"])
    dist.init_process_group(
        "nccl" if use_cuda else "gloo",
        init_method=f"tcp://{info['master_addr']}:{info['master_port']}",
        rank=info["rank"], world_size=info["world"], timeout=timedelta(seconds=600),
    )
    return torch.device("cuda", info["local_rank"]) if use_cuda else torch.device("cpu")
