"""Start ranks: N local processes (gloo on the CPU, or NCCL with one GPU each), or join
the group torchrun/Slurm describes. The device is decided once, by ``choose_device``, and
carried in the run's layout (``RunLayout.device``) to every rank.

``device``: the device choice and each rank's GPU. ``local``: ``spawn_local`` and
``run_local``, the supervised local launch (it restarts all ranks after a fault, forwards
preemption signals to them and never leaves a rank running). ``scheduler``: rank, world and
rendezvous from torchrun/Slurm variables. ``rendezvous``: the store a launched run meets in,
the vote on rank 0's decision before any process group, and joining the group. ``job``: a
command's launch from those parts (``prepare`` then ``start``: usp-train's and usp-eval's),
its exit codes and the requeue of a preempted Slurm job; imported as ``usp.launch.job``."""

from .device import BACKENDS, DEVICE_SETTINGS, choose_device, cuda_index
from .local import FORWARDED_SIGNALS, free_port, run_local, spawn_local
from .rendezvous import (RendezvousError, SharedRefusal, decide_together, init_from_env,
                         rendezvous_store, start_together)
from .scheduler import launcher_env

__all__ = ["BACKENDS", "DEVICE_SETTINGS", "FORWARDED_SIGNALS", "RendezvousError",
           "SharedRefusal", "choose_device", "cuda_index", "decide_together", "free_port",
           "init_from_env", "launcher_env", "rendezvous_store", "run_local", "spawn_local",
           "start_together"]
