"""The runner of a run's length phases: ``train`` runs one ordinary ``Trainer`` per phase.

A run is a sequence of phases (``usp.run.PhasePlan``; a run without phases is one). Each
phase is a trainer built from the phase's config and layout, told where to start (the
checkpoint the run stands at, or the one the phase before ended with, and its position)
and when to stop (its step bound, ``Leg.end``, and its gate, ``PhaseStop.holds``). What the
run knows about its phases is the runner's: the position a checkpoint records for the run
(``PhasePosition``: the phase, the steps where the phases started, the tokens before this
one, the first phase's final validation loss), the gate's reference loss, the ``phase_end``
label of a phase's last record and the console's line about it, and each phase's heading.
``planned`` takes the run's plan as the resolver gave it (or resolves it inside a group),
``records`` opens the run's metrics and console once for every phase.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist

from ..config import RunConfig
from ..run import PhasePlan, RunLayout, resolve_phases_group, tiled_config
from .build import phase_schedule
from .checkpointer import Position, newest
from .console import Console
from .fingerprint import run_fingerprint
from .metrics import MetricsLogger, PeakMemory
from .trainer import FaultHook, Leg, Stop, Trainer


@dataclass(frozen=True)
class PhasePosition:
    """Where a run stands after ``step`` optimizer steps (global, across phases): its phase
    trainer's ``Position`` (``consumed`` samples drawn in the current phase, ``skipped``
    non-finite steps), ``phase`` the 0-based length phase the next step belongs to,
    ``starts`` the global steps completed before each phase started so far,
    ``tokens_before`` the tokens seen in the phases before it, and ``reference`` the
    validation loss at the end of the first phase (a gate's ``val_loss_within``), or None."""

    step: int = 0
    consumed: int = 0
    skipped: int = 0
    phase: int = 0
    starts: tuple[int, ...] = (0,)
    tokens_before: int = 0
    reference: float | None = None

    @property
    def trainer(self) -> Position:
        """The position of the phase's trainer."""
        return Position(self.step, self.consumed, self.skipped)

    def tokens_seen(self, seq_len: int) -> int:
        """Tokens seen over every phase, this one at ``seq_len`` tokens a sample."""
        return self.tokens_before + self.consumed * seq_len

    def next_phase(self, seq_len: int) -> PhasePosition:
        """The position a phase boundary after ``step`` hands on: the next phase, from
        step ``step``, its own samples from 0 (this one's at ``seq_len``)."""
        return replace(self, phase=self.phase + 1, starts=(*self.starts, self.step),
                       consumed=0, tokens_before=self.tokens_seen(seq_len))

    def record(self) -> dict:
        """What a checkpoint's ``extra.pt`` keeps of it (``consumed`` as before phases); at a
        boundary (the next phase, nothing consumed yet) ``global_batch`` None: the next
        phase's layout has its own, so a resume into it says no "batch changed"."""
        out = {**self.trainer.record(), "phase": self.phase, "starts": list(self.starts),
               "tokens_before": self.tokens_before, "reference_val_loss": self.reference}
        if self.consumed == 0 and self.starts[-1] == self.step:
            out["global_batch"] = None
        return out

    @classmethod
    def of(cls, extra: dict, global_batch: int) -> PhasePosition:
        """The position a checkpoint's ``extra`` records (``Position.of``); one from before
        phases is in phase 0."""
        at = Position.of(extra, global_batch)
        return cls(at.step, at.consumed, at.skipped, extra.get("phase", 0),
                   tuple(extra.get("starts", (0,))), extra.get("tokens_before", 0),
                   extra.get("reference_val_loss"))


class PhaseStop(Stop):
    """Phase ``at.phase`` of ``plan``, run from ``at``, as its trainer's ``Stop``: its gate
    (``until``) at each validation, ``phase_end`` in its last record, and the run's position
    in each of its checkpoints (at its end, the next phase's)."""

    def __init__(self, plan: PhasePlan, at: PhasePosition):
        self.plan, self.at, self.phase = plan, at, plan[at.phase]
        self.final = at.phase == len(plan) - 1

    def holds(self, step: int, summary: dict) -> bool:
        """Whether the phase's gate holds on a validation's scores: they are all-reduced (the
        passkey's broadcast), so every rank decides alike."""
        gate = self.phase.until
        return gate is not None and gate.holds(summary.get(f"passkey_acc/{self.phase.seq_len}"),
                                               summary.get("short_val_loss"), self.at.reference)

    def labels(self, summary: dict, early: bool) -> dict:
        """``phase_end``: what ended the phase (its gate or its steps), in a run of phases or
        under a gate."""
        if len(self.plan) > 1 or self.phase.until is not None:
            return {"phase_end": "gate" if early else "steps"}
        return {}

    def after(self, summary: dict, at: Position, ends: bool) -> PhasePosition:
        """The run's position after the trainer's ``at``; at the phase's end (``ends``) with
        the first phase's final validation loss, and the next phase's unless it is the last."""
        now = replace(self.at, step=at.step, consumed=at.consumed, skipped=at.skipped)
        if ends and self.phase.index == 0:  # the first phase's final validation loss
            now = replace(now, reference=summary.get("val_loss"))
        return now.next_phase(self.phase.seq_len) if ends and not self.final else now

    def record(self, summary: dict, at: Position, ends: bool) -> dict:
        return self.after(summary, at, ends).record()


def planned(cfg: RunConfig, run: RunLayout | PhasePlan | None) -> PhasePlan:
    """The run's phases: ``run`` as the resolver gave it (``usp.run.resolve_phases``), a
    layout as one phase, or for a caller that made the process group itself the phases rank 0
    resolves for it (``resolve_phases_group``), on the device its backend computes on. The
    resolver checked them; the mesh checks each layout's world when it is built."""
    if run is None:
        # rank 0 prints the planner's tables
        run = resolve_phases_group(cfg, "cuda" if dist.get_backend() == "nccl" else "cpu")
    return run if isinstance(run, PhasePlan) else PhasePlan.single(tiled_config(cfg, run), run)


@contextmanager
def records(cfg: RunConfig, plan: PhasePlan, at: PhasePosition) -> Iterator[tuple]:
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
    the lr schedule's, the metrics' and the console's, whose total is the run's steps); each
    phase's ``Trainer`` reads its own ``Phase.cfg`` alone (``phase_config`` overlays no
    trainer setting but ``trainer.global_batch_tokens``, which its layout holds).

    Phases run one after another in these processes, a ``Trainer`` each: at each boundary a
    checkpoint (recording the next phase's position), the phase's model, optimizer and mesh
    closed, the next phase's built (mesh, sequence layout, model with its RoPE settings,
    data) and the checkpoint loaded into it (DCP reshards it). A resume reads which phase
    the newest checkpoint is in before it builds anything.

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
    fingerprint = run_fingerprint(cfg, plan)
    ckpt, extra = newest(cfg.trainer, plan[0].run.run_dir, fingerprint)  # before any mesh
    at = PhasePosition() if ckpt is None else PhasePosition.of(extra, plan[0].run.global_batch)
    start, report = at.step, ckpt is not None
    with records(cfg, plan, at) as (logger, console):  # every phase's metrics, closed once
        while True:
            phase, stop = plan[at.phase], PhaseStop(plan, at)
            if dist.get_rank() == 0 and len(plan) > 1:
                print(plan.describe(phase.index, at.starts), flush=True)  # its steps as run
            trainer = Trainer(phase.cfg, phase.run, _leg(cfg, plan, at, fingerprint),
                              _log(logger, console, phase.until), fault_hook, memory_probe,
                              from_checkpoint=ckpt is not None)
            with trainer.running():  # closes the phase's model and mesh, on every path
                trainer.resume(ckpt, report)  # the newest checkpoint, or the boundary's
                summary, end, ckpt, ended = trainer.loop(at.trainer, stop)
                if not ended or stop.final:  # the run's last step, stop_after, no step left
                    console.close()  # the bar ends before the last figures
                    trainer.finish(summary)
                    logger.finish(summary)
                    plot = logger.plot()
                    break
            at, report = stop.after(summary, end, True), False  # the next phase, from ckpt
    trainer.report(summary, start, plot)
    return summary


def _log(logger: MetricsLogger, console: Console, gate) -> Callable[[dict], None]:
    """A phase's ``log``: each record to the metrics and the console, then, after the
    phase's last, the console's line on what ended it (its gate ``gate`` or its steps)."""

    def log(record: dict) -> None:
        logger.log(record)
        console.log(record)
        console.phase_end(record, gate)

    return log


def _leg(cfg: RunConfig, plan: PhasePlan, at: PhasePosition, fingerprint: dict) -> Leg:
    """What the trainer of phase ``at.phase`` is told (``cfg``: the base config): its last
    step, the run's lr schedule from the steps where the phases started, the run's
    fingerprint, its phase in every record, the tokens before it, its own data passes, and
    in a later phase the first phase's data, whose validation it scores too."""
    k = at.phase
    return Leg(end=plan.end(k, at.starts), lr=cfg.optim.lr,
               schedule=phase_schedule(cfg.optim, plan, at.starts), fingerprint=fingerprint,
               tags={"phase": k + 1}, tokens_before=at.tokens_before, passes=k,
               short=plan[0].cfg.data if k > 0 else None)
