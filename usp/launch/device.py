"""The device a launch computes on: ``trainer.device`` -> (backend, device type), and the GPU
each rank drives."""

from __future__ import annotations


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
