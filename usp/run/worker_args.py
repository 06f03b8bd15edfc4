"""What ``usp-train`` and ``usp-eval`` hand the launcher to decide before any process group
(``usp.launch.job.prepare``'s ``decide`` and ``check``): the workers' arguments and the
ranks' device type, resolved here. The launcher calls down into the resolver, never back
into the command that called it."""

from __future__ import annotations

from dataclasses import replace

from ..config import RunConfig
from ..eval.job import plan_eval
from .phase_layouts import check_phase_tasks, resolve_phases, tiled_config
from .resolve import resolve_eval, scheduler_hosts_notice


def training_args(cfg: RunConfig, run_dir: str | None, world: int, device: str,
                  info: dict | None, say) -> tuple[tuple, str]:
    """usp-train's worker arguments ``(plan.cfg, plan)`` and the ranks' device type; every bad
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


def check_training_args(args: tuple) -> None:
    """A torchrun/Slurm task other than rank 0: this task on rank 0's layouts, its device
    included."""
    check_phase_tasks(args[1])


def eval_args(cfg: RunConfig, out: str | None, world: int, device: str, info: dict | None,
              say) -> tuple[tuple, str]:
    """usp-eval's worker arguments (EvalJob, RunLayout) and the ranks' device type: every bad
    input refused here, before any process group; the planner's table (forward-only memory)
    said when it chose a degree."""
    job = plan_eval(cfg, out)
    run = resolve_eval(job.cfg, world, device, job.lengths, say=say)
    job = replace(job, cfg=tiled_config(job.cfg, run))  # an auto loss_chunk/mlp_tiles sized
    return (job, run), run.device
