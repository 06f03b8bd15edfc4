"""Length phases (``trainer.phases``): a run grown in context, one resolved layout per phase.

A run is a sequence of **phases** (the word "stages" is the a2a pipeline's): each phase
trains at its own ``seq_len`` with the base config overlaid by the phase's keys
(``data.seq_len``, RoPE, lr, batch, parallel degrees), under its own ``RunLayout``, all
resolved before any process group exists. A run without ``trainer.phases`` is one phase
made of today's keys (``PhasePlan.single``).

Steps count globally across phases: phase k's planned steps are
``planned_starts[k] + 1 .. planned_starts[k] + steps``. A phase with a gate (``until``) may
end earlier; the steps where phases actually started are recorded in the checkpoints
(``starts``), and ``phase_at`` reads a global step against them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

from ..config import RunConfig
from ..config.phases import phase_heading
from .run_layout import RunLayout


@dataclass(frozen=True)
class PhaseGate:
    """When a phase may end before its ``steps`` (checked at each validation, every rank
    alike, from all-reduced scores): every criterion given must hold.

    ``passkey_acc``: passkey accuracy at the phase's own length at least this;
    ``val_loss_within``: the validation loss at the first phase's length within this
    relative margin of its value at the end of the first phase (0.02: at most 2% above)."""

    passkey_acc: Optional[float] = None
    val_loss_within: Optional[float] = None

    def holds(self, passkey_acc: Optional[float], loss: Optional[float],
              reference: Optional[float]) -> bool:
        """Whether every criterion given holds for one validation's scores: ``passkey_acc``
        (at the phase's length), ``loss`` (the validation loss at the first phase's length)
        against ``reference`` (its value at the end of the first phase). A criterion whose
        score is None cannot be decided: ValueError naming it."""
        missing = [name for name, need, have in (
            ("passkey_acc (eval.during_training at the phase's length)",
             self.passkey_acc, passkey_acc),
            ("val_loss_within (the validation split at the first phase's length, and its "
             "value at the end of the first phase)", self.val_loss_within,
             None if loss is None or reference is None else loss))
            if need is not None and have is None]
        if missing:
            raise ValueError(f"the phase's gate (until) needs {' and '.join(missing)}, which "
                             f"this run does not score; configure it or drop the criterion")
        ok = self.passkey_acc is None or passkey_acc >= self.passkey_acc
        return ok and (self.val_loss_within is None
                       or loss <= (1 + self.val_loss_within) * reference)


@dataclass(frozen=True)
class Phase:
    """One phase of a run: ``index`` (0-based), ``cfg`` (the base config with this phase's
    keys overlaid), ``run`` (its layout, resolved for ``cfg``), ``steps`` (its planned
    optimizer steps, the upper bound under a gate), ``lr`` (a new peak with its own warmup,
    or None: the run's schedule continues) and ``until`` (its gate, or None)."""

    index: int
    cfg: RunConfig
    run: RunLayout
    steps: int
    lr: Optional[float] = None
    until: Optional[PhaseGate] = None

    @property
    def seq_len(self) -> int:
        return self.run.seq_len


@dataclass(frozen=True)
class PhasePlan:
    """The phases of one run, in order, every layout resolved. ``cfg``: the base config
    with ``trainer.steps`` the planned total (``total_steps``), the config ``train`` takes
    with the plan (``usp.run.resolve_phases`` and ``single`` set it; None only in a plan
    made by hand)."""

    phases: tuple[Phase, ...]
    cfg: Optional[RunConfig] = None

    def __post_init__(self) -> None:
        if not self.phases:
            raise ValueError("a phase plan needs at least one phase")

    @classmethod
    def single(cls, cfg: RunConfig, run: RunLayout) -> PhasePlan:
        """A run without ``trainer.phases``: one phase of ``trainer.steps`` steps."""
        return cls((Phase(0, cfg, run, cfg.trainer.steps),), cfg)

    def __len__(self) -> int:
        return len(self.phases)

    def __getitem__(self, k: int) -> Phase:
        return self.phases[k]

    @property
    def total_steps(self) -> int:
        """Steps of the whole run when no gate ends a phase early (``trainer.steps``)."""
        return sum(p.steps for p in self.phases)

    @property
    def planned_starts(self) -> tuple[int, ...]:
        """Global steps completed before each phase, when no gate ends one early."""
        out, at = [], 0
        for p in self.phases:
            out.append(at)
            at += p.steps
        return tuple(out)

    def starts_of(self, starts: Sequence[int]) -> tuple[int, ...]:
        """Global steps completed before every phase: the recorded ``starts`` of the phases
        that have started, then the planned ones after them."""
        out = list(starts)
        for k in range(len(out), len(self.phases)):
            out.append(out[-1] + self.phases[k - 1].steps)
        return tuple(out)

    def end(self, k: int, starts: Sequence[int]) -> int:
        """The last global step phase ``k`` may run (the end of its planned steps from its
        start), given the recorded ``starts``; a gate may end it earlier."""
        return self.starts_of(starts)[k] + self.phases[k].steps

    def phase_at(self, step: int, starts: Sequence[int] | None = None) -> int:
        """The 0-based phase that 1-based global step ``step`` belongs to, given the steps
        completed before each phase that has started (``starts``; default: the planned
        ones). A phase ends at the earlier of its planned steps and the next start."""
        starts = list(self.planned_starts if starts is None else starts)
        k = max((i for i, s in enumerate(starts) if step > s), default=0)
        end = starts[k] + self.phases[k].steps  # the started phase runs at most its steps,
        while step > end and k + 1 < len(self.phases):  # then the rest follow as planned
            k += 1
            end += self.phases[k].steps
        return k

    def describe(self, k: int, starts: Sequence[int] | None = None) -> str:
        """Phase ``k``'s heading (0-based ``k``; ``usp.config.phases.phase_heading``) with
        its layout and accumulation, e.g. ``phase 2/3: seq_len 4096, ulysses 2 x ring 2 (dp
        1), K=2, steps 301..400, rope_theta 40000``: its steps as planned, or from the
        recorded ``starts`` (a gate may have ended a phase before it early)."""
        p, r = self.phases[k], self.phases[k].run
        start = self.starts_of(starts or (0,))[k]
        entries = self.cfg.trainer.phases if self.cfg is not None else None
        return phase_heading(k, len(self), r.seq_len, start + 1, start + p.steps, p.cfg.model,
                             p.lr, p.until, layout=f"ulysses {r.ulysses} x ring {r.ring} "
                                                   f"(dp {r.dp}), K={r.grad_accum}",
                             blend=entries[k].blend if entries else None)
