"""Faults inside the training loop: preemption signals and non-finite numbers.

Preemption: a scheduler (Slurm ``--signal``, Kubernetes, torchrun) sends SIGTERM or SIGUSR1
some time before it kills the job. ``Preemption`` only records the signal; at the next step
boundary every rank agrees on it (one all-reduce), the trainer writes a checkpoint for that
step and raises ``Preempted``, whose ``exit_code`` (``PREEMPTED_EXIT_CODE``) the launcher
turns into the process exit code. Resuming from that run directory loses no step.

Non-finite numbers: ``NonFiniteError`` (a ``ValueError``: the launcher does not restart a run
that would hit the same NaN again) names the step and the value; ``NonFiniteGuard`` applies
``trainer.on_nonfinite`` (stop | skip) and counts skipped steps.
"""

from __future__ import annotations

import math
import signal
import threading
from typing import Self

import torch
import torch.distributed as dist

from ..config import parse_signals
from ..launch.job import PREEMPTED_EXIT_CODE  # the launcher requeues a job that exits with it
MAX_CONSECUTIVE_SKIPS = 10  # on_nonfinite=skip: this many non-finite steps in a row stop the run


class Preempted(Exception):
    """Raised by ``train`` on every rank after the preemption checkpoint of ``step`` is written.

    ``exit_code`` (``PREEMPTED_EXIT_CODE``) is what the launcher exits with."""

    exit_code = PREEMPTED_EXIT_CODE

    def __init__(self, step: int, signal_name: str, checkpoint: str):
        self.step, self.signal_name, self.checkpoint = step, signal_name, checkpoint
        super().__init__(f"preempted by {signal_name} at step {step}: checkpoint {checkpoint} "
                         f"written; exit code {PREEMPTED_EXIT_CODE}; rerun with the same "
                         f"trainer.run_dir and trainer.resume=true to continue")


class NonFiniteError(ValueError):
    """The global loss or grad norm of ``step`` is NaN/inf; raised before the optimizer step
    and before any checkpoint of that step, so the newest checkpoint is the last good one."""

    def __init__(self, step: int, what: str, value: float, detail: str = ""):
        self.step, self.what, self.value = step, what, value
        super().__init__(f"non-finite {what} ({value}) at step {step}{detail}; the optimizer did "
                         f"not step and the newest checkpoint is from before it; lower optim.lr, "
                         f"raise optim.warmup_steps or lower optim.grad_clip, or set "
                         f"trainer.on_nonfinite=skip to skip such steps")


class Preemption:
    """Record the first of ``signals`` this process receives (the handler only sets a flag).

    ``install()`` replaces the handlers (main thread only; elsewhere nothing is installed),
    ``restore()`` puts the previous ones back; also a context manager. ``agree(device)`` is
    collective over the world: the signal any rank received, or None, the same on every rank.
    """

    def __init__(self, signals: str | list[signal.Signals]):
        self.signals = parse_signals(signals) if isinstance(signals, str) else list(signals)
        self.received: signal.Signals | None = None
        self._previous: dict[signal.Signals, object] = {}

    @property
    def requested(self) -> bool:
        return self.received is not None

    def _handle(self, signum, frame) -> None:
        if self.received is None:
            self.received = signal.Signals(signum)

    def install(self) -> Self:
        if threading.current_thread() is threading.main_thread():
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def __enter__(self) -> Self:
        return self.install()

    def __exit__(self, *exc) -> None:
        self.restore()

    def agree(self, device: torch.device | str = "cpu") -> signal.Signals | None:
        """Collective (world): so that a signal delivered to some ranks stops all of them at
        the same step. With several signals, the highest number wins."""
        flag = torch.tensor([int(self.received or 0)], dtype=torch.int64, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return signal.Signals(int(flag.item())) if flag.item() else None


class NonFiniteGuard:
    """``trainer.on_nonfinite``: ``check(step, loss, grad_norm)`` returns True when the step
    must be skipped, raises ``NonFiniteError`` when the run must stop, False when all is finite.

    ``loss`` and ``grad_norm`` must be global (the same on every rank), so every rank decides
    alike. ``skipped``: steps skipped so far in this process."""

    def __init__(self, mode: str, max_consecutive: int = MAX_CONSECUTIVE_SKIPS):
        if mode not in ("stop", "skip"):
            raise ValueError(f"trainer.on_nonfinite={mode!r} is not one of stop, skip; "
                             f"use trainer.on_nonfinite=stop")
        self.mode, self.max_consecutive = mode, max_consecutive
        self.skipped = self.consecutive = 0

    def check(self, step: int, loss: float, grad_norm: float) -> bool:
        bad = next(((what, v) for what, v in (("loss", loss), ("grad norm", grad_norm))
                    if not math.isfinite(v)), None)
        if bad is None:
            self.consecutive = 0
            return False
        if self.mode == "stop":
            raise NonFiniteError(step, *bad)
        self.skipped += 1
        self.consecutive += 1
        if self.consecutive >= self.max_consecutive:
            raise NonFiniteError(step, *bad, f" ({self.consecutive} consecutive non-finite "
                                             f"steps skipped, the most trainer.on_nonfinite=skip "
                                             f"allows)")
        return True
