"""The run's phases as ``train`` takes them (``planned``: a plan, a layout or nothing,
checked against this group) and the records every phase of a run writes to (``records``:
the metrics and the console, opened once for the run)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

import torch.distributed as dist

from ..config import RunConfig
from ..run import PhasePlan, RunLayout, resolve_phases_group
from .checkpointer import Position
from .console import Console
from .metrics import MetricsLogger


def planned(cfg: RunConfig, run: RunLayout | PhasePlan | None) -> PhasePlan:
    """The run's phases: ``run``, a layout as one phase, or for a caller that made the
    process group itself the phases rank 0 resolves for it (``resolve_phases_group``), on
    the device its backend computes on."""
    if run is None:
        # rank 0 prints the planner's tables
        run = resolve_phases_group(cfg, "cuda" if dist.get_backend() == "nccl" else "cpu")
    plan = run if isinstance(run, PhasePlan) else PhasePlan.single(cfg, run)
    run_dirs = {p.run.run_dir for p in plan.phases}
    if None in run_dirs:
        raise ValueError("the run has no run directory: set trainer.run_dir=PATH (usp-train "
                         "takes Hydra's output folder when it is not set)")
    if len(run_dirs) > 1:
        raise ValueError(f"the phases were resolved for different run directories "
                         f"{sorted(run_dirs)}; resolve every phase with the same run_dir")
    for p in plan.phases:
        if p.run.world != dist.get_world_size():
            raise ValueError(f"phase {p.index + 1} was laid out for {p.run.world} ranks but "
                             f"this group has {dist.get_world_size()}; resolve it for this "
                             f"launch (usp.run.resolve_run)")
    return plan


@contextmanager
def records(cfg: RunConfig, plan: PhasePlan, at: Position) -> Iterator[tuple]:
    """The run's ``MetricsLogger`` (from step ``at.step``) and ``Console``, for every phase;
    closed once, however the run ends."""
    rank = dist.get_rank()
    layouts = {"layout": asdict(plan[at.phase].run)}
    if len(plan) > 1:
        layouts["phases"] = [asdict(p.run) for p in plan.phases]
    logger = MetricsLogger(cfg.logging, Path(plan[0].run.run_dir), rank,
                           {**asdict(cfg), **layouts}, resume_step=at.step)
    console = Console(rank, cfg.trainer.log_every, cfg.logging.progress, cfg.trainer.steps,
                      at.step)
    try:
        yield logger, console
    finally:
        console.close()
        logger.close()
