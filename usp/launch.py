"""Start ranks: N local processes (gloo on the CPU, or NCCL with one GPU each), or join
the group torchrun/Slurm describes. The device is decided once, here, by ``choose_device``."""

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


BACKENDS = {"cpu": "gloo", "cuda": "nccl"}  # device type -> process-group backend
DEVICE_SETTINGS = ("auto", "cpu", "cuda")  # trainer.device


def choose_device(
    setting: str, nprocs: int, cuda_available: bool, gpu_count: int
) -> tuple[str, str]:
    """(backend, device type) for ``nprocs`` ranks on this machine: ``("gloo", "cpu")`` or
    ``("nccl", "cuda")`` with one GPU per rank.

    ``setting`` is ``trainer.device``: ``cpu``; ``cuda`` (refused without a GPU for every
    rank); ``auto`` (cuda when a GPU is visible, else cpu). Pure: the caller passes
    ``torch.cuda.is_available()`` and ``torch.cuda.device_count()``. Raises ``ValueError``
    before anything is started.
    """
    if setting not in DEVICE_SETTINGS:
        raise ValueError(f"trainer.device must be one of {', '.join(DEVICE_SETTINGS)}, "
                         f"got {setting!r}")
    gpus = gpu_count if cuda_available else 0
    if setting == "cpu" or (setting == "auto" and gpus == 0):
        return BACKENDS["cpu"], "cpu"
    if gpus == 0:
        raise ValueError("trainer.device=cuda but this process sees 0 CUDA GPUs; use "
                         "trainer.device=cpu (or auto: CUDA only when a GPU is visible)")
    if gpus < nprocs:
        raise ValueError(f"trainer.device={setting}: {nprocs} ranks need one GPU each but "
                         f"{gpus} GPUs are visible; set trainer.nprocs={gpus} (or fewer) "
                         f"or trainer.device=cpu")
    return BACKENDS["cuda"], "cuda"


def cuda_index(local_rank: int, visible: int) -> int:
    """The GPU (index among the ``visible`` ones) that the rank with ``local_rank`` drives.

    torchrun shows every GPU of the node to every rank: index = local rank. Slurm with one
    GPU per task shows each task only its own GPU (cuda:0) while SLURM_LOCALID still
    counts 0, 1, ...: hence the modulo.
    """
    if visible < 1:
        raise ValueError(f"local rank {local_rank} needs a GPU but {visible} are visible; "
                         f"use trainer.device=cpu")
    return local_rank % visible


def _worker(rank, world, port, threads, device_type, fn, args):
    torch.set_num_threads(threads)
    if device_type == "cuda":
        torch.cuda.set_device(rank)  # rank i drives cuda:i; set before NCCL binds a device
    dist.init_process_group(
        BACKENDS[device_type],
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=300),
    )
    try:
        fn(*args)
        dist.barrier()  # nobody tears down the group while a peer still talks to it
    finally:
        dist.destroy_process_group()


def spawn_local(fn, world_size: int, *args, threads: int | None = None,
                device_type: str = "cpu") -> None:
    """Call ``fn(*args)`` on ``world_size`` fresh processes joined in one process group.

    ``device_type="cpu"`` (default): gloo. ``"cuda"``: NCCL, rank i on ``cuda:i`` (pick it
    with ``choose_device``, which checks there are enough GPUs). ``fn`` must be importable
    (module level). A failure on any rank raises here with the rank's traceback.
    ``threads`` is torch's intra-op threads per process (default: the CPU count shared
    evenly, at least 1).
    """
    if device_type not in BACKENDS:
        raise ValueError(f"device_type must be cpu or cuda, got {device_type!r}")
    if threads is None:
        threads = max(1, (os.cpu_count() or 1) // world_size)
    mp.start_processes(
        _worker,
        args=(world_size, free_port(), threads, device_type, fn, args),
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
    """Join the process group described by ``launcher_env``; returns this rank's device.

    ``device`` is ``trainer.device`` (see ``choose_device``); on CUDA the rank drives GPU
    ``cuda_index(local_rank, visible GPUs)``. ``ValueError`` (e.g. cuda without a GPU) is
    raised before joining.
    """
    visible = torch.cuda.device_count()
    backend, device_type = choose_device(device, 1, torch.cuda.is_available(), visible)
    index = None
    if device_type == "cuda":
        index = cuda_index(info["local_rank"], visible)
        torch.cuda.set_device(index)  # before NCCL binds a device
    dist.init_process_group(
        backend,
        init_method=f"tcp://{info['master_addr']}:{info['master_port']}",
        rank=info["rank"], world_size=info["world"], timeout=timedelta(seconds=600),
    )
    return torch.device(device_type, index)
