"""How ``usp-train`` starts its ranks (``usp.launch.job``, as ``usp-eval`` does): the run's
plan (``usp.run.PhasePlan``: a ``RunLayout`` per length phase, one without
``trainer.phases``) is resolved once by the resolver (``usp.run.training_args``), before any
process starts training: in the parent of the spawned ranks, or under torchrun/Slurm by rank 0
before any process group, checked by every other task on its own config and machine
(``usp.run.check_training_args``). Every rank then runs ``train(plan.cfg,
plan)``."""

from __future__ import annotations

from functools import partial

from ..config import RunConfig
from ..launch.job import Job, prepare, start
from ..run import check_training_args, training_args
from .phase_runner import train


def training_job(cfg: RunConfig, run_dir: str | None = None) -> Job:
    """usp-train's job, decided before any process group. ``run_dir``: where the run writes
    when ``trainer.run_dir`` is not set (Hydra's folder)."""
    return prepare(partial(training_args, cfg, run_dir), cfg.trainer, check_training_args)


def run_job(job: Job, cfg: RunConfig) -> None:
    """Train on every rank of ``job``; a preempted Slurm job requeues itself after its
    checkpoint (``trainer.requeue``); the ranks' exit code becomes this process's."""
    code = start(job, train, cfg.trainer, requeue=cfg.trainer.requeue,
                 max_restarts=cfg.trainer.max_restarts)
    if code:
        raise SystemExit(code)
