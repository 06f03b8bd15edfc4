"""The run's phases as ``train`` takes them (``planned``: a plan, a layout or nothing), the
records every phase of a run writes to (``records``: the metrics and the console, opened
once for the run) and ``train``, which runs them."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist

from ..config import RunConfig
from ..run import PhasePlan, RunLayout, resolve_phases_group
from .checkpointer import Position, newest
from .console import Console
from .fingerprint import run_fingerprint
from .metrics import MetricsLogger, PeakMemory
from .trainer import FaultHook, Trainer


def planned(cfg: RunConfig, run: RunLayout | PhasePlan | None) -> PhasePlan:
    """The run's phases: ``run`` as the resolver gave it (``usp.run.resolve_phases``), a
    layout as one phase, or for a caller that made the process group itself the phases rank 0
    resolves for it (``resolve_phases_group``), on the device its backend computes on. The
    resolver checked them; the mesh checks each layout's world when it is built."""
    if run is None:
        # rank 0 prints the planner's tables
        run = resolve_phases_group(cfg, "cuda" if dist.get_backend() == "nccl" else "cpu")
    return run if isinstance(run, PhasePlan) else PhasePlan.single(cfg, run)


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


def train(cfg: RunConfig, run: RunLayout | PhasePlan | None = None,
          fault_hook: FaultHook | None = None,
          memory_probe: Callable[[torch.device], PeakMemory] = PeakMemory) -> dict:
    """Train ``cfg.trainer.steps`` steps, phase after phase; returns the summary of the last
    step (every rank).

    ``run``: the run's phases (``usp.run.phases.PhasePlan``: each phase's config and layout,
    resolved before any process group), or the layout of a run without phases
    (``usp.run.resolve_run``: one phase); None: resolved here, once, by rank 0 for the group
    (``resolve_phases_group``), for a caller that made the process group itself. Degrees,
    placement, a2a chunks, device, dtype and per-rank batch come from the phase's layout,
    not from ``cfg.parallel`` or the backend. ``cfg`` is the base config (the fingerprint's,
    and the loop's ``trainer`` settings); each phase builds from its own ``Phase.cfg``.

    Phases run one after another in these processes: at each boundary a checkpoint, the
    phase's model, optimizer and mesh closed, the next phase's built (mesh, sequence layout,
    model with its RoPE settings, data) and the checkpoint loaded into it (DCP reshards it).
    A resume reads which phase the newest checkpoint is in before it builds anything.

    Faults (``usp.train.faults``): a signal in ``trainer.preempt_signals`` on any rank makes
    every rank checkpoint at the next step boundary and raise ``Preempted`` (its
    ``exit_code`` is the process's; SIGTERM is ignored from then on, as the process is
    ending); a non-finite global loss or grad norm raises
    ``NonFiniteError`` before the optimizer step (``trainer.on_nonfinite=stop``) or skips the
    step (``skip``). ``fault_hook(step, loss_sum) -> loss_sum`` (tests): called on every rank
    with the 1-based step and this rank's loss sum before backward; it may send a signal or
    return a changed loss. ``memory_probe(device)`` builds the per-step memory probe
    (``start()`` at each step start, ``peak_mb()`` after the optimizer step).
    """
    plan = planned(cfg, run)
    cfg = plan.cfg or cfg  # with phases: trainer.steps is their total
    ckpt, at = newest(cfg.trainer, plan[0].run.run_dir, run_fingerprint(cfg, plan),
                      plan[0].run.global_batch)  # where the run stands, before any mesh
    start, report = at, ckpt is not None
    with records(cfg, plan, at) as (logger, console):  # every phase's metrics, closed once
        while True:
            trainer = Trainer(cfg, plan, at, (logger, console), fault_hook, memory_probe,
                              from_checkpoint=ckpt is not None)
            with trainer.running():  # closes the phase's model and mesh, on every path
                trainer.resume(ckpt, report)  # the newest checkpoint, or the boundary's
                summary, boundary = trainer.loop(at)
                if boundary is None:  # the run's last step, or trainer.stop_after
                    plot = trainer.finish(summary)
                    break
            (ckpt, at), report = boundary, False  # the next phase, from its checkpoint
    trainer.report(summary, start, plot)
    return summary
