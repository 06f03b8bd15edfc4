"""Run metrics on rank 0: console, a JSONL file, wandb (offline unless asked), a PNG plot;
and the per-step peak memory every rank can measure.

wandb runs in a service process of its own (wandb-core), and Slurm's ``scancel`` or
preemption sends SIGTERM to every process of the job step, that one included: it dies at
once, while the ranks still have a step to finish and a checkpoint to write. So no wandb
call may stop the run: each one is bounded in time (``WANDB_WAIT_S``), and the first that
fails or hangs turns wandb off for the rest of the run with one warning; ``metrics.jsonl``
goes on. (The service cannot be kept out of the signal: it is a Go program, and Go's runtime
installs its own SIGTERM handler whatever the handler or mask it inherits.)
"""

from __future__ import annotations

import json
import os
import resource
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import torch

from ..config import LoggingConfig
from .curves import curves_png
from .wandb_procs import WandbHelpers

# The longest one wandb call (log, summary, finish) may take. A live service answers in
# milliseconds; a stopped or stuck one never does, and a dead one fails at once. An online
# run's final upload is cut there too: what is left stays in run_dir/wandb for `wandb sync`.
WANDB_WAIT_S = 10.0
# After a failure: how long wandb may take to let go (restore the console it captured and
# drop its exit hook, which would otherwise wait at exit on a stuck service).
WANDB_RELEASE_S = 2.0


def _bounded(fn: Callable[[], object], seconds: float) -> str | None:
    """Run ``fn()`` in a daemon thread and wait at most ``seconds``: None when it returned,
    else what went wrong, ``"<ExceptionType>: <message>"`` or ``"no answer in <seconds> s"``
    (the thread is then left behind; a daemon, it cannot hold up the exit)."""
    failed: list[str] = []

    def call() -> None:
        try:
            fn()
        except BaseException as e:  # wandb.teardown may raise SystemExit: it ends this thread only
            failed.append(f"{type(e).__name__}: {e}")

    thread = threading.Thread(target=call, name="usp-wandb", daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        return f"no answer in {seconds:g} s"
    return failed[0] if failed else None


def _release_wandb(run) -> None:
    """Let go of a failed wandb: ``teardown`` first drops wandb's exit hook (then waits for,
    or fails on, the service), ``finish`` restores the console wandb captured; errors are
    expected, the service being gone or stuck."""
    import wandb

    for step in [wandb.teardown] + ([run.finish] if run is not None else []):
        try:
            step()
        except BaseException:  # as in _bounded: SystemExit from teardown too
            pass


class PeakMemory:
    """Peak memory of one step in MiB: call ``start()`` at the step start, ``peak_mb()`` at its end.

    ``kind`` names the measure:

    - ``"cuda_allocated"``: torch's peak of allocated CUDA memory on ``device``, reset by
      ``start()`` (``reset_peak_memory_stats``), read by ``max_memory_allocated``;
    - ``"rss_step"``: peak resident set size of the process since ``start()``; Linux resets
      the high-water mark (VmHWM in ``<proc>/status``) when "5" is written to
      ``<proc>/clear_refs``;
    - ``"rss_since_start"``: where that reset is refused, the peak RSS since the process
      started (``ru_maxrss``), which can only grow from step to step.

    ``proc`` is the procfs directory of this process (tests pass a fake one).
    """

    def __init__(self, device: torch.device | str, proc: str | Path = "/proc/self"):
        self.device, self._proc = torch.device(device), Path(proc)
        if self.device.type == "cuda":
            self.kind = "cuda_allocated"
        else:
            self.kind = "rss_step" if self._reset_rss() else "rss_since_start"

    def start(self) -> None:
        if self.kind == "cuda_allocated":
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self.kind == "rss_step":
            self._reset_rss()

    def peak_mb(self) -> float:
        if self.kind == "cuda_allocated":
            return torch.cuda.max_memory_allocated(self.device) / 2**20
        if self.kind == "rss_step":
            return self._vm_hwm_kib() / 1024
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB

    def _reset_rss(self) -> bool:
        """Reset the RSS high-water mark; False where the kernel or a sandbox refuses."""
        try:
            fd = os.open(self._proc / "clear_refs", os.O_WRONLY)  # never creates the file
            try:
                os.write(fd, b"5")
            finally:
                os.close(fd)
            return self._vm_hwm_kib() is not None
        except OSError:
            return False

    def _vm_hwm_kib(self) -> int | None:
        for line in (self._proc / "status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])  # "VmHWM:   123456 kB"
        return None


def phase_table(records: list[dict]) -> list[dict]:
    """One row per length phase of the step records (``metrics.jsonl``, those with a
    ``phase``): its layout (``seq_len``, ``dp``, ``ring``, ``ulysses``), its ``steps``
    [first, last], the ``tokens`` it trained on, its mean ``step_s`` and ``tokens_per_s``
    (tokens over the summed step times), its last ``val_loss``, ``short_val_loss`` and
    ``passkey_acc`` ({length: accuracy}) where it scored them, and ``ended_by`` (``gate`` or
    ``steps``, its step bound) for a run of phases or a gated one."""
    rows: dict[int, list[dict]] = {}
    for r in records:
        if "loss" in r and "phase" in r:  # a step's record, not step 0's validation alone
            rows.setdefault(r["phase"], []).append(r)
    table, before = [], 0
    for phase, recs in sorted(rows.items()):
        first, last = recs[0], recs[-1]
        tokens, seconds = last["tokens_seen"] - before, sum(r["step_s"] for r in recs)
        row = {"phase": phase, **{k: first[k] for k in ("seq_len", "dp", "ring", "ulysses")},
               "steps": [first["step"], last["step"]], "tokens": tokens,
               "step_s": seconds / len(recs), "tokens_per_s": tokens / seconds}
        if "phase_end" in last:  # what ended it: its gate or its step bound
            row["ended_by"] = last["phase_end"]
        for key in ("val_loss", "short_val_loss"):
            scored = [r[key] for r in recs if key in r]
            if scored:
                row[key] = scored[-1]
        passkey = [r for r in recs if any(k.startswith("passkey_acc/") for k in r)]
        if passkey:
            row["passkey_acc"] = {k.split("/", 1)[1]: v for k, v in passkey[-1].items()
                                  if k.startswith("passkey_acc/")}
        table.append(row)
        before = last["tokens_seen"]
    return table


class MetricsLogger:
    """Writes one record per step. Construct on every rank; only rank 0 writes.

    wandb never stops the run: its first call that fails or takes longer than
    ``WANDB_WAIT_S`` prints one warning and turns wandb off; the other backends go on."""

    def __init__(self, cfg: LoggingConfig, run_dir: Path, rank: int, run_config: dict,
                 resume_step: int = 0):
        self.cfg, self.run_dir, self.active = cfg, Path(run_dir), rank == 0
        self.jsonl_path = self.run_dir / "metrics.jsonl"
        self._wandb = None
        self._helpers = WandbHelpers()
        if not self.active:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if cfg.jsonl:
            self._drop_records_after(resume_step)
        if cfg.wandb not in ("offline", "online", "disabled"):
            raise ValueError(f"logging.wandb must be offline, online or disabled, got {cfg.wandb!r}")
        if cfg.wandb != "disabled":
            os.environ.setdefault("WANDB_SILENT", "true")
            error = None
            try:  # bounded by wandb itself (init_timeout), before any step
                import wandb

                self._wandb = wandb.init(
                    project=cfg.project, mode=cfg.wandb, dir=str(self.run_dir),
                    config=run_config, resume="allow", id=self._wandb_id(),
                )
            except Exception as e:
                error = f"{type(e).__name__}: {e}"
            self._helpers = WandbHelpers.started_by(os.getpid())  # a failed init may leave some too
            if error is not None:
                self._wandb_failed(error)

    def _wandb_call(self, fn: Callable[[object], object]) -> None:
        """``fn(run)`` on the wandb run, bounded; the first failure turns wandb off."""
        run = self._wandb
        error = _bounded(lambda: fn(run), WANDB_WAIT_S)
        if error is not None:
            self._wandb_failed(error)

    def _wandb_failed(self, error: str) -> None:
        """One warning, then the run goes on without wandb."""
        kept = ("metrics.jsonl keeps every metric" if self.cfg.jsonl
                else "logging.jsonl=false: no file keeps the metrics")
        print(f"warning: wandb failed ({error}); wandb logging is off for the rest of this "
              f"run; {kept}", file=sys.stderr, flush=True)
        run, self._wandb = self._wandb, None
        _bounded(lambda: _release_wandb(run), WANDB_RELEASE_S)
        self._helpers.stop()  # the monitor outlives a dead service otherwise

    def _wandb_id(self) -> str:
        """A stable id per run directory, so a resumed run continues the same wandb run."""
        path = self.run_dir / "wandb_id.txt"
        if not path.exists():
            import uuid

            path.write_text(uuid.uuid4().hex[:12])
        return path.read_text().strip()

    def _drop_records_after(self, step: int) -> None:
        """On resume, forget records of steps past the checkpoint (they will be redone)."""
        if not self.jsonl_path.exists():
            return
        keep = [ln for ln in self.jsonl_path.read_text().splitlines()
                if ln.strip() and json.loads(ln).get("step", 0) <= step]
        self.jsonl_path.write_text("".join(k + "\n" for k in keep))

    def log(self, record: dict) -> None:
        if not self.active:
            return
        if self.cfg.jsonl:
            with open(self.jsonl_path, "a") as f:
                f.write(json.dumps(record) + "\n")
        if self._wandb is not None:
            values = {k: v for k, v in record.items() if k != "step"}
            self._wandb_call(lambda run: run.log(values, step=record["step"]))

    def finish(self, summary: dict) -> None:
        """Final figures of the run: ``run_dir/summary.json`` (with ``phases``, the table of
        ``phase_table``, when the records name their phase) and the wandb run summary."""
        if not self.active:
            return
        table = phase_table(self.records())
        summary = {**summary, "phases": table} if table else summary
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        if self._wandb is not None:
            self._wandb_call(lambda run: run.summary.update(summary))

    def records(self) -> list[dict]:
        if not self.jsonl_path.exists():
            return []
        return [json.loads(ln) for ln in self.jsonl_path.read_text().splitlines() if ln.strip()]

    def plot(self) -> Path | None:
        """The run's curves (``usp.train.curves``) as ``run_dir/curves.png``."""
        if not (self.active and self.cfg.plot):
            return None
        return curves_png(self.records(), self.run_dir / "curves.png")

    def close(self) -> None:
        """Finish the wandb run and stop its service (each at most ``WANDB_WAIT_S``), then end
        whatever of wandb's helper processes is still alive; the other backends need nothing.
        Stopping the service now, not in wandb's exit hook, matters on Slurm: a requeue or
        ``scancel`` kills it before this process exits, and the hook would then print a
        ``ConnectionResetError`` traceback."""
        if self._wandb is not None:
            self._wandb_call(lambda run: run.finish())
        if self._wandb is not None:
            import wandb

            self._wandb_call(lambda run: wandb.teardown())
            self._wandb = None
        self._helpers.stop()
