"""The run as rank 0 shows it while it trains: ``Console``.

A terminal gets a progress bar (``logging.progress``); a job's log file (Slurm, nohup) gets
the step lines alone. Every step goes to ``metrics.jsonl`` and wandb through
``usp.train.metrics.MetricsLogger``; the console prints a line of every metric only every
``trainer.log_every`` steps and at each validation.
"""

from __future__ import annotations

import sys

from ..config.phases import gate_text


class Console:
    """Rank 0's step lines and progress bar; on other ranks ``log`` does nothing.

    ``should_log(record)``: whether the step summary ``record`` (with its 1-based
    ``"step"``) gets a line; ``log(record)`` advances the bar and prints that line;
    ``close()`` ends the bar (again: nothing)."""

    def __init__(self, rank: int, log_every: int, progress: bool, steps: int, start: int):
        self.rank, self.every = rank, log_every
        self.bar = None
        if rank == 0 and progress and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=steps, initial=start, desc="train", dynamic_ncols=True)

    def should_log(self, record: dict) -> bool:
        return self.rank == 0 and (bool(self.every and record["step"] % self.every == 0)
                                   or "val_loss" in record
                                   or any(k.startswith("passkey_acc/") for k in record))

    def log(self, record: dict) -> None:
        if self.bar is not None and "loss" in record:  # step 0's validation is no step
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{record['loss']:.3f}",
                                 **({"acc": f"{record['acc']:.2f}"} if "acc" in record else {}))
        if self.should_log(record):
            line = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                            for k, v in record.items())
            self.bar.write(line) if self.bar is not None else print(line, flush=True)

    def phase_end(self, record: dict, gate) -> None:
        """At the step that ended a length phase (its record has ``phase_end``), one line
        saying what ended it: its gate (``gate``, a ``PhaseGate``) or its step bound, and a
        gate that never held with its last scores."""
        if self.rank == 0 and "phase_end" in record:
            line = phase_end_line(record, gate)
            self.bar.write(line) if self.bar is not None else print(line, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def phase_end_line(record: dict, gate) -> str:
    """What ended the phase of ``record`` (the record of its last step, with ``phase_end``
    ``gate`` or ``steps``), under its gate ``gate`` (None: it had none)."""
    head = f"usp: phase {record['phase']} ended at step {record['step']}"
    if record["phase_end"] == "gate":
        return f"{head}: its gate held ({gate_text(gate)})"
    if gate is None:
        return f"{head}, its step bound"
    last = ", ".join(f"{k}={record[k]:.4g}" for k in
                     (f"passkey_acc/{record['seq_len']}", "short_val_loss") if k in record)
    return (f"{head}, its step bound: its gate ({gate_text(gate)}) never held"
            + (f"; at this last validation {last}" if last else ""))
