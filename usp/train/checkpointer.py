"""When a trainer checkpoints and what it resumes from: ``Checkpointer`` and ``newest``.

``should_save(step)`` says whether optimizer step ``step`` (1-based) ends with a checkpoint,
``save`` writes it (``usp.models.checkpoint.save_checkpoint``: the model and optimizer shards,
the schedule, this rank's RNG, the trainer's ``Position`` and what the runner around the
trainer records beside it), ``load`` restores one. ``newest`` finds the newest checkpoint that
verifies and reads its record before anything is built (the runner reads there which layout
to build). Every checkpoint carries the run fingerprint (``usp.train.fingerprint``); a resume
with other settings is refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import TrainerConfig
from ..models.checkpoint import (check_resume, choose_checkpoint, load_checkpoint, read_manifest,
                                 save_checkpoint)
from ..run import RunLayout


@dataclass(frozen=True)
class Position:
    """Where a trainer stands after ``step`` optimizer steps (the run's count): ``consumed``
    samples drawn from its data (the data position, whatever dp and accumulation drew them)
    and ``skipped`` non-finite steps skipped (``trainer.on_nonfinite=skip``)."""

    step: int = 0
    consumed: int = 0
    skipped: int = 0

    def record(self) -> dict:
        """What a checkpoint's ``extra.pt`` keeps of it."""
        return {"skipped_steps": self.skipped, "consumed": self.consumed}

    @classmethod
    def of(cls, extra: dict, global_batch: int) -> Position:
        """The position a checkpoint's ``extra`` records; one from before the data position
        counts ``step x global_batch`` samples."""
        step = extra["step"]
        return cls(step, extra.get("consumed", step * global_batch),
                   extra.get("skipped_steps", 0))


def newest(tc: TrainerConfig, run_dir: str, fingerprint: dict) -> tuple[Path | None, dict]:
    """Collective over the default group (before any mesh): with ``trainer.resume``, the
    newest checkpoint that verifies (``choose_checkpoint``: every rank checks a share of its
    files, all take the same one) and its record (``extra.pt``: its step, the trainer's
    position and what the runner recorded), read from its small files alone after its
    fingerprint is checked (ValueError on every rank alike); else (None, {})."""
    ckpt = choose_checkpoint(run_dir) if tc.resume else None
    if ckpt is None:
        return None, {}
    manifest = read_manifest(ckpt)
    if manifest is not None:
        check_resume(manifest.get("fingerprint", {}), fingerprint, ckpt)
    return ckpt, torch.load(Path(ckpt) / "extra.pt", weights_only=False)


class Checkpointer:
    """The checkpoints of one trainer of a run in ``run.run_dir/checkpoints`` (``save``/``load``
    are collective: every rank calls them).

    A step ends with a checkpoint every ``trainer.ckpt_every`` steps, at the trainer's last
    step (``end``; default ``trainer.steps``), where its stop ends its loop (``ends``), at
    ``trainer.stop_after`` and when the run is preempted; ``trainer.keep_checkpoints``
    complete ones are kept."""

    def __init__(self, tc: TrainerConfig, run: RunLayout, fingerprint: dict, rank: int,
                 end: int | None = None, records: dict | None = None):
        self.run_dir = Path(run.run_dir)
        self.every, self.keep = tc.ckpt_every, tc.keep_checkpoints
        self.last = tc.steps if end is None else end
        self.stop_after, self.seed = tc.stop_after, tc.seed
        self.run, self.fingerprint, self.rank = run, fingerprint, rank
        self.records = records  # the trainer's model config and data record, in each checkpoint

    def should_save(self, step: int, preempted: bool = False, ends: bool = False) -> bool:
        """Whether 1-based optimizer step ``step`` ends with a checkpoint (``ends``: the
        trainer's loop ends there)."""
        return bool((self.every and step % self.every == 0) or step == self.last
                    or step == self.stop_after or preempted or ends)

    def save(self, step: int, model, opt, sched, at: Position, extra: dict | None = None
             ) -> Path:
        """Collective: the checkpoint of ``step`` (``at``: the trainer's position after it);
        returns its directory. ``extra``: what the runner records beside it; its keys win (a
        runner that hands the checkpoint on to another trainer records that one's position,
        and ``global_batch`` None for a batch that trainer has yet to say)."""
        # the data position: samples consumed, so any later dp and accumulation continue it;
        # this layout's batch: a resume under another says that it changed
        record = {**at.record(), "global_batch": self.run.global_batch, **(extra or {})}
        return save_checkpoint(self.run_dir, step, model, opt, sched, keep=self.keep,
                               extra=record, fingerprint=self.fingerprint,
                               records=self.records)

    def load(self, ckpt: Path | None, model, opt, sched, report: bool = True) -> None:
        """Collective: checkpoint ``ckpt`` (``newest``'s, or the one the trainer before this one
        just wrote) loaded into ``model``, ``opt``, ``sched`` (DCP reshards it to this
        trainer's layout) and this rank's RNG; nothing for None. ``report``: rank 0 says where
        the run resumed."""
        if ckpt is None:
            return
        extra = load_checkpoint(ckpt, model, opt, sched, fingerprint=self.fingerprint)
        step = extra["step"]
        if not extra["rng_restored"]:
            torch.manual_seed(self.seed + 1000 * step + self.rank)
        if self.rank == 0 and report:
            self._report(ckpt, Position.of(extra, self.run.global_batch),
                         extra.get("global_batch"))

    def _report(self, ckpt: Path, at: Position, before: int | None) -> None:
        run = self.run
        print(f"resumed from {ckpt} at step {at.step} ({at.consumed} samples consumed); a step "
              f"is {run.global_batch} samples: dp {run.dp} x {run.grad_accum} "
              f"micro-batch(es) of {run.batch_per_dp_rank}", flush=True)
        if before is not None and before != run.global_batch:  # e.g. fewer nodes, no T
            print(f"usp: the global batch changed from {before} to {run.global_batch} "
                  f"samples per step; trainer.global_batch_tokens keeps it across layouts",
                  flush=True)
