"""When the trainer checkpoints and what it resumes from: ``Checkpointer``.

``should_save(step)`` says whether optimizer step ``step`` (1-based) ends with a checkpoint,
``save`` writes it (``usp.models.checkpoint.save_checkpoint``: the model and optimizer shards,
the schedule, this rank's RNG and the data position), ``load`` resumes from the newest one
that verifies. Every checkpoint carries the run fingerprint (``usp.train.fingerprint``); a
resume with other settings is refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import TrainerConfig
from ..models.checkpoint import choose_checkpoint, load_checkpoint, save_checkpoint
from ..run import RunLayout


@dataclass(frozen=True)
class Position:
    """Where a run stands after ``step`` optimizer steps: ``consumed`` global samples drawn
    (the data position, whatever dp and accumulation drew them), ``skipped`` non-finite
    steps skipped (``trainer.on_nonfinite=skip``)."""

    step: int = 0
    consumed: int = 0
    skipped: int = 0


class Checkpointer:
    """The checkpoints of one run in ``run.run_dir/checkpoints`` (``save``/``load`` are
    collective: every rank calls them).

    A step ends with a checkpoint every ``trainer.ckpt_every`` steps, at the last step
    (``trainer.steps``), at ``trainer.stop_after`` and when the run is preempted;
    ``trainer.keep_checkpoints`` complete ones are kept. ``load`` looks only when
    ``trainer.resume`` is set."""

    def __init__(self, tc: TrainerConfig, run: RunLayout, fingerprint: dict, rank: int):
        self.run_dir = Path(run.run_dir)
        self.every, self.keep, self.resume = tc.ckpt_every, tc.keep_checkpoints, tc.resume
        self.last, self.stop_after, self.seed = tc.steps, tc.stop_after, tc.seed
        self.run, self.fingerprint, self.rank = run, fingerprint, rank

    def should_save(self, step: int, preempted: bool = False) -> bool:
        """Whether 1-based optimizer step ``step`` ends with a checkpoint."""
        return bool((self.every and step % self.every == 0) or step == self.last
                    or step == self.stop_after or preempted)

    def save(self, step: int, model, opt, sched, at: Position) -> Path:
        """Collective: the checkpoint of ``step`` (``at``: the position after it); returns
        its directory."""
        # the data position: samples consumed, so any later dp and accumulation continue it
        return save_checkpoint(self.run_dir, step, model, opt, sched, keep=self.keep,
                               extra={"skipped_steps": at.skipped, "consumed": at.consumed,
                                      "global_batch": self.run.global_batch},
                               fingerprint=self.fingerprint)

    def load(self, model, opt, sched) -> Position:
        """Collective: with ``trainer.resume``, the newest checkpoint that verifies (every
        rank verifies a share of its files; all take the same one) loaded into ``model``,
        ``opt``, ``sched`` and this rank's RNG; its position. ``Position()`` (step 0) when
        there is none or resume is off."""
        ckpt = choose_checkpoint(self.run_dir) if self.resume else None
        if ckpt is None:
            return Position()
        extra = load_checkpoint(ckpt, model, opt, sched, fingerprint=self.fingerprint)
        step = extra["step"]
        # the data position: samples consumed (a checkpoint from before it: steps x batch)
        at = Position(step, extra.get("consumed", step * self.run.global_batch),
                      extra.get("skipped_steps", 0))
        if not extra["rng_restored"]:
            torch.manual_seed(self.seed + 1000 * step + self.rank)
        if self.rank == 0:
            self._report(ckpt, at, extra.get("global_batch"))
        return at

    def _report(self, ckpt: Path, at: Position, before: int | None) -> None:
        run = self.run
        print(f"resumed from {ckpt} at step {at.step} ({at.consumed} samples consumed); a step "
              f"is {run.global_batch} samples: dp {run.dp} x {run.grad_accum} "
              f"micro-batch(es) of {run.batch_per_dp_rank}", flush=True)
        if before is not None and before != run.global_batch:  # e.g. fewer nodes, no T
            print(f"usp: the global batch changed from {before} to {run.global_batch} "
                  f"samples per step; trainer.global_batch_tokens keeps it across layouts",
                  flush=True)
