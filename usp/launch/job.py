"""A command's launch, for ``usp-train`` and ``usp-eval`` alike: ``prepare`` decides the
plan before any process group, ``start`` runs ``worker(*args)`` on every rank and says how
the ranks ended.

- Local (no torchrun/Slurm variables): the device is chosen for ``trainer.nprocs`` ranks,
  ``decide`` runs here, in the parent, and ``run_local`` spawns the ranks.
- torchrun/Slurm: rank 0 runs ``decide`` for the allocation and every other task ``check``s
  the value on its own config and machine; the verdicts meet in the rendezvous store
  (``decide_together``), so a refusal is said once, before any process group. Then every
  task joins the group and runs the worker.

A preemptible worker (``requeue`` not None) stops on a preemption by raising an exception
whose int ``exit_code`` is ``PREEMPTED_EXIT_CODE`` after its checkpoint; a preempted Slurm
batch job is then requeued when ``requeue`` is true (``usp.slurm.requeue``). Under submitit
an outcome that is not a requeue is raised as ``JobError``, so that the submitter reads it.
"""

from __future__ import annotations

import gc
import os
import signal
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from .. import slurm
from ..config.trainer import TrainerConfig
from .device import choose_device
from .local import run_local, threads_per_rank
from .rendezvous import decide_together, init_from_env, rendezvous_store
from .scheduler import launcher_env

# sysexits.h EX_TEMPFAIL, "temporary failure, the user is invited to retry": the run stopped
# on a preemption signal after writing a checkpoint; requeue it with trainer.resume=true.
PREEMPTED_EXIT_CODE = 75
# what a preempted Slurm job says when trainer.requeue=false (launched or local alike)
NOT_REQUEUED = "trainer.requeue=false: not requeued; submit it again to resume"

# decide(world, device, info, say) -> (the worker's arguments, the device type the ranks use);
# info: the torchrun/Slurm task (``launcher_env``), None for a local launch
Decide = Callable[[int, str, "dict | None", Callable[[str], None]], tuple[tuple, str]]


class JobError(RuntimeError):
    """Under submitit: what the command would print and exit with, as an exception, so that
    submitit writes it as the job's result and the submitter reports it (a ``SystemExit``
    would leave no result and the submitter polling)."""


def under_submitit() -> bool:
    return slurm.under_submitit(os.environ)


# what the resolver says (the planner's table, the balance): print itself, so that saying a
# line does not call back up into the launcher
_say = partial(print, flush=True)


@dataclass
class Job:
    """What ``prepare`` decided: the worker's ``args``, the ranks' ``device`` type, and for
    a torchrun/Slurm task its ``info`` and rendezvous ``store``."""

    args: tuple
    device: str
    info: dict | None = None
    store: Any = None


def prepare(decide: Decide, tc: TrainerConfig, check: Callable[[tuple], None] | None = None
            ) -> Job:
    """Decide the job before any process group (every bad input refused here, as
    ``ValueError``; under torchrun/Slurm as ``SharedRefusal`` on every task)."""
    info = launcher_env()
    if info is None:
        _, device = choose_device(tc.device, tc.nprocs, torch.cuda.is_available(),
                                  torch.cuda.device_count())  # the run's device, decided once
        threads_per_rank(device, tc.nprocs, None)  # a bad OMP_NUM_THREADS, before any decision
        return Job(*decide(tc.nprocs, device, None, _say))
    said = []  # rank 0's planner table, said once every task agreed

    def decided():
        _, device = choose_device(tc.device, 1, torch.cuda.is_available(),
                                  torch.cuda.device_count())  # the run's device, decided once
        return decide(info["world"], device, info, said.append)

    def checked(value):
        if check is not None:
            check(value[0])

    store = rendezvous_store(info, tc.timeout_s)
    args, device = decide_together(store, info, decided, checked, tc.timeout_s)
    for text in said:
        _say(text)
    return Job(args, device, info, store)


def start(job: Job, worker: Callable[..., Any], tc: TrainerConfig,
          requeue: bool | None = None, max_restarts: int = 0) -> int:
    """Run ``worker(*job.args)`` on every rank (``worker``: module level, importable);
    returns 0 or the ranks' exit code. ``requeue``: None for a worker that is never
    preempted; else whether a preempted Slurm batch job requeues itself. ``max_restarts``:
    local launch, how often all ranks start again after a fault (``run_local``)."""
    if job.info is None:
        code = run_local(worker, tc.nprocs, *job.args, device_type=job.device,
                         max_restarts=max_restarts,
                         timeout_s=tc.timeout_s)
        if code and requeue is not None:  # the ranks' own code, e.g. preempted after a SIGTERM
            _local_exit(code, requeue)
        return code
    # refuses a missing GPU before joining; trainer.timeout_s bounds every collective
    init_from_env(job.info, job.device, timeout_s=tc.timeout_s, store=job.store)
    preempted, requeued, line = None, False, ""
    try:
        worker(*job.args)
    except Exception as e:  # every rank checkpointed at e.step
        if requeue is None or not isinstance(getattr(e, "exit_code", None), int):
            raise
        preempted = e
        requeued, line = _requeue(job.info, requeue)
    finally:
        gc.collect()  # the worker closed its mesh; free what is left before the world goes
        dist.destroy_process_group()
    if preempted is None:
        return 0
    if under_submitit() and not requeued:  # the submitter learns it from the result
        raise JobError(f"usp-train: {preempted}; {line}")
    raise SystemExit(preempted.exit_code)


def _requeue(info: dict, requeue: bool) -> tuple[bool, str]:
    """After the preemption checkpoint (collective): rank 0 requeues the Slurm batch job
    (``trainer.requeue``) and every rank learns whether it did."""
    # requeueing ends this job step with SIGTERM: the ranks finish exiting first, with 75
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if info["kind"] != "slurm":
        return False, "not a Slurm job: not requeued; run it again to resume"
    if not requeue:
        return False, NOT_REQUEUED
    dist.barrier()  # every rank ignores SIGTERM before rank 0 asks Slurm to end the step
    outcome = [slurm.requeue(os.environ) if info["rank"] == 0 else None]
    if info["rank"] == 0:
        print(f"usp: {outcome[0][1]}", flush=True)
    dist.broadcast_object_list(outcome, src=0)
    return outcome[0]


def _local_exit(code: int, requeue: bool) -> None:
    """The local launcher's ranks exited with ``code``. Inside a one-task Slurm job (the
    launcher spawns the ranks) a preemption requeues the job as a multi-task one does;
    under submitit the outcome is raised as ``JobError`` unless the job was requeued."""
    line = f"the ranks exited with {code}"
    requeued = False
    if code == PREEMPTED_EXIT_CODE and os.environ.get("SLURM_JOB_ID"):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the requeue ends this step
        if requeue:
            requeued, line = slurm.requeue(os.environ)
        else:
            line = NOT_REQUEUED
        print(f"usp: {line}", flush=True)
    if under_submitit() and not requeued:
        raise JobError(f"usp-train: {line}")
    raise SystemExit(code)
