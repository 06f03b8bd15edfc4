"""How ``usp-train`` starts its ranks (``usp.launch.job``, as ``usp-eval`` does): the run's
plan (``usp.run.PhasePlan``: a ``RunLayout`` per length phase, one without
``trainer.phases``) is resolved once, before any process starts training: in the parent of
the spawned ranks, or under torchrun/Slurm by rank 0 before any process group, checked by
every other task on its own config and machine. Every rank then runs ``train(plan.cfg,
plan)``."""

from __future__ import annotations

from functools import partial

from ..config import RunConfig
from ..launch.job import Job, prepare, start
from ..run import check_phase_tasks, resolve_phases, scheduler_hosts_notice
from .trainer import train


def _decide(cfg: RunConfig, run_dir: str | None, world: int, device: str, info: dict | None,
            say) -> tuple[tuple, str]:
    """The worker's arguments ``(plan.cfg, plan)`` and the ranks' device type; every bad
    layout or input refused here (resolve_phases includes the data checks: vocabulary,
    validation split)."""
    slurm = info is not None and info["kind"] == "slurm"
    if slurm:  # the scheduler's hosts are the topology, not a recipe's
        notice = scheduler_hosts_notice(cfg, info["placement"] or "from Slurm")
        if notice:
            print(f"usp: {notice}", flush=True)
    # every rank composed its own config; rank 0's run directory is the run's
    plan = resolve_phases(cfg, world, device, scheduler_hosts=slurm, run_dir=run_dir, say=say)
    return (plan.cfg, plan), plan[0].run.device


def _check(args: tuple) -> None:
    check_phase_tasks(args[1])  # this task on rank 0's layouts, its device included


def training_job(cfg: RunConfig, run_dir: str | None = None) -> Job:
    """usp-train's job, decided before any process group. ``run_dir``: where the run writes
    when ``trainer.run_dir`` is not set (Hydra's folder)."""
    return prepare(partial(_decide, cfg, run_dir), cfg.trainer, _check)


def run_job(job: Job, cfg: RunConfig) -> None:
    """Train on every rank of ``job``; a preempted Slurm job requeues itself after its
    checkpoint (``trainer.requeue``); the ranks' exit code becomes this process's."""
    code = start(job, train, cfg.trainer, requeue=cfg.trainer.requeue,
                 max_restarts=cfg.trainer.max_restarts)
    if code:
        raise SystemExit(code)
