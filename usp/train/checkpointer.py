"""When the trainer checkpoints and what it resumes from: ``Checkpointer`` and ``newest``.

``should_save(step)`` says whether optimizer step ``step`` (1-based) ends with a checkpoint,
``save`` writes it (``usp.models.checkpoint.save_checkpoint``: the model and optimizer shards,
the schedule, this rank's RNG and the run's ``Position``), ``load`` restores one. ``newest``
finds the newest checkpoint that verifies and reads its position before anything is built
(the phase it is in decides the layout to build). Every checkpoint carries the run
fingerprint (``usp.train.fingerprint``); a resume with other settings is refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ..config import TrainerConfig
from ..models.checkpoint import (check_resume, choose_checkpoint, load_checkpoint, read_manifest,
                                 save_checkpoint)
from ..run import RunLayout


@dataclass(frozen=True)
class Position:
    """Where a run stands after ``step`` optimizer steps (global, across phases):
    ``consumed`` samples drawn in the current phase (the data position, whatever dp and
    accumulation drew them), ``skipped`` non-finite steps skipped
    (``trainer.on_nonfinite=skip``), ``phase`` the 0-based length phase the next step
    belongs to, ``starts`` the global steps completed before each phase started so far,
    ``tokens_before`` the tokens seen in the phases before it, and ``reference`` the
    validation loss at the end of the first phase (a gate's ``val_loss_within``), or None."""

    step: int = 0
    consumed: int = 0
    skipped: int = 0
    phase: int = 0
    starts: tuple[int, ...] = (0,)
    tokens_before: int = 0
    reference: float | None = None

    def tokens_seen(self, seq_len: int) -> int:
        """Tokens seen over every phase, this one at ``seq_len`` tokens a sample."""
        return self.tokens_before + self.consumed * seq_len

    def next_phase(self, seq_len: int) -> Position:
        """The position a phase boundary after ``step`` hands on: the next phase, from
        step ``step``, its own samples from 0 (this one's at ``seq_len``)."""
        return replace(self, phase=self.phase + 1, starts=(*self.starts, self.step),
                       consumed=0, tokens_before=self.tokens_seen(seq_len))

    def record(self) -> dict:
        """What a checkpoint's ``extra.pt`` keeps of it (``consumed`` as before phases)."""
        return {"skipped_steps": self.skipped, "consumed": self.consumed, "phase": self.phase,
                "starts": list(self.starts), "tokens_before": self.tokens_before,
                "reference_val_loss": self.reference}

    @classmethod
    def of(cls, extra: dict, global_batch: int) -> Position:
        """The position a checkpoint's ``extra`` records; one from before the data position
        counts ``step x global_batch`` samples, one from before phases is in phase 0."""
        step = extra["step"]
        return cls(step, extra.get("consumed", step * global_batch),
                   extra.get("skipped_steps", 0), extra.get("phase", 0),
                   tuple(extra.get("starts", (0,))), extra.get("tokens_before", 0),
                   extra.get("reference_val_loss"))


def newest(tc: TrainerConfig, run_dir: str, fingerprint: dict,
           global_batch: int) -> tuple[Path | None, Position]:
    """Collective over the default group (before any mesh): with ``trainer.resume``, the
    newest checkpoint that verifies (``choose_checkpoint``: every rank checks a share of its
    files, all take the same one) and its position, read from its small files alone after
    its fingerprint is checked (ValueError on every rank alike); else (None, ``Position()``).
    ``global_batch``: the first phase's, for a checkpoint from before the data position."""
    ckpt = choose_checkpoint(run_dir) if tc.resume else None
    if ckpt is None:
        return None, Position()
    manifest = read_manifest(ckpt)
    if manifest is not None:
        check_resume(manifest.get("fingerprint", {}), fingerprint, ckpt)
    extra = torch.load(Path(ckpt) / "extra.pt", weights_only=False)
    return ckpt, Position.of(extra, global_batch)


class Checkpointer:
    """The checkpoints of one phase of a run in ``run.run_dir/checkpoints`` (``save``/``load``
    are collective: every rank calls them).

    A step ends with a checkpoint every ``trainer.ckpt_every`` steps, at the phase's last step
    (``end``; default ``trainer.steps``), where a gate ends the phase, at
    ``trainer.stop_after`` and when the run is preempted; ``trainer.keep_checkpoints``
    complete ones are kept."""

    def __init__(self, tc: TrainerConfig, run: RunLayout, fingerprint: dict, rank: int,
                 end: int | None = None, records: dict | None = None):
        self.run_dir = Path(run.run_dir)
        self.every, self.keep = tc.ckpt_every, tc.keep_checkpoints
        self.last = tc.steps if end is None else end
        self.stop_after, self.seed = tc.stop_after, tc.seed
        self.run, self.fingerprint, self.rank = run, fingerprint, rank
        self.records = records  # the phase's model config and data record, in each checkpoint

    def should_save(self, step: int, preempted: bool = False, ends_phase: bool = False) -> bool:
        """Whether 1-based optimizer step ``step`` ends with a checkpoint."""
        return bool((self.every and step % self.every == 0) or step == self.last
                    or step == self.stop_after or preempted or ends_phase)

    def save(self, step: int, model, opt, sched, at: Position) -> Path:
        """Collective: the checkpoint of ``step`` (``at``: the position after it; at a phase
        boundary, the next phase's); returns its directory."""
        # the data position: samples consumed, so any later dp and accumulation continue it;
        # this layout's batch, unless the position is a phase boundary's (the next phase,
        # nothing consumed yet, has its own): a resume then says no "batch changed"
        boundary = at.consumed == 0 and at.starts[-1] == step
        batch = None if boundary else self.run.global_batch
        return save_checkpoint(self.run_dir, step, model, opt, sched, keep=self.keep,
                               extra={**at.record(), "global_batch": batch},
                               fingerprint=self.fingerprint, records=self.records)

    def load(self, ckpt: Path | None, model, opt, sched, report: bool = True) -> None:
        """Collective: checkpoint ``ckpt`` (``newest``'s, or the one a phase boundary just
        wrote) loaded into ``model``, ``opt``, ``sched`` (DCP reshards it to this phase's
        layout) and this rank's RNG; nothing for None. ``report``: rank 0 says where the run
        resumed."""
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
