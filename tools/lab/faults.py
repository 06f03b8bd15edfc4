"""The fault-injection campaign: real ``usp-train`` runs, each hit by one fault.

Every scenario runs ``python -m usp.cli`` (the ``usp-train`` entry point) as a subprocess on
local gloo ranks with a small config, injects its fault from outside (a signal to the
launcher or to one rank, a damaged checkpoint file, a diverging learning rate, a stopped
rank), then checks what a cluster operator expects: the run ends with a named error or a
checkpoint, no rank is left running, and a resumed run reaches the same final loss as an
uninterrupted one. ``tools.fault_campaign`` prints the table.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# a small run: 4 ranks as 2 simulated nodes x 2, ulysses 2 x ring 2, 24 steps
BASE = ["parallel.ulysses_degree=2", "parallel.ring_degree=2",
        "parallel.ranks_per_node=2", "trainer.nprocs=4", "trainer.device=cpu",
        "trainer.steps=24", "trainer.ckpt_every=6", "trainer.log_every=0", "data.seq_len=128",
        "data.batch_per_dp_rank=4", "data.eval_batches=0", "logging.wandb=disabled", "logging.plot=false",
        "logging.progress=false", "optim.warmup_steps=4"]


@dataclass
class Outcome:
    """One row of the campaign table."""

    fault: str
    happened: str
    steps_lost: int | None
    ok: bool


@dataclass
class Run:
    rc: int
    out: str
    err: str
    seconds: float

    def last_line(self) -> str:
        lines = [ln for ln in (self.err + self.out).splitlines() if ln.strip()]
        return lines[-1] if lines else ""


def _children(pid: int) -> list[int]:
    """Every descendant process of ``pid`` (from /proc), depth first."""
    kids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == pid:
            kids.append(int(entry.name))
    return [d for k in kids for d in [k, *_children(k)]]


def _alive(pids: list[int]) -> list[int]:
    alive = []
    for p in pids:
        try:
            state = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            alive.append(p)
    return alive


def metrics(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]


def last_step(run_dir: Path) -> int:
    recs = metrics(run_dir)
    return recs[-1]["step"] if recs else 0


def usp_train(run_dir: Path, extra=(), act=None, timeout: float = 600,
              grace: float = 3.0) -> tuple[Run, list[int]]:
    """Run usp-train with ``BASE`` + ``extra`` into ``run_dir``; ``act(proc, ranks)`` is called
    every 0.2 s while it runs (return True once it has acted). Returns the run and the
    processes of its tree still alive ``grace`` s after the launcher ended (should be none)."""
    cmd = [sys.executable, "-m", "usp.cli", *BASE, *extra, f"trainer.run_dir={run_dir}",
           f"hydra.run.dir={run_dir}/hydra"]
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM"))}
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    seen: set[int] = set()
    acted = act is None
    deadline = t0 + timeout
    while proc.poll() is None and time.perf_counter() < deadline:
        ranks = _children(proc.pid)
        seen.update(ranks)
        if not acted:
            acted = bool(act(proc, ranks))
        time.sleep(0.2)
    if proc.poll() is None:
        proc.kill()
    out, err = proc.communicate()
    until = time.perf_counter() + grace  # the tree gets `grace` s to go after its launcher
    while (left := _alive(sorted(seen))) and time.perf_counter() < until:
        time.sleep(0.1)
    for p in left:  # leave nothing behind, even when the run did
        try:
            os.kill(p, signal.SIGKILL)
        except OSError:
            pass
    return Run(proc.returncode, out, err, time.perf_counter() - t0), left


def final_loss(run_dir: Path) -> float:
    recs = metrics(run_dir)
    return recs[-1]["loss"] if recs else math.nan


def same_loss(a: float, b: float, rel: float = 1e-6) -> bool:
    return math.isfinite(a) and math.isfinite(b) and abs(a - b) <= rel * abs(b)


# ---- the scenarios ------------------------------------------------------------------------
def _when_step(run_dir: Path, step: int, action):
    """An ``act`` for ``usp_train``: once ``step`` is logged, call ``action(proc, ranks)``."""
    def act(proc, ranks):
        if last_step(run_dir) >= step and ranks:
            action(proc, ranks)
            return True
        return False
    return act


def _checkpoints(run_dir: Path) -> list[int]:
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    return sorted(int(p.name.split("_")[1]) for p in root.iterdir()
                  if p.name.startswith("step_") and not p.name.endswith(".tmp"))


def _cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


def _rank_pids(ranks: list[int]) -> list[int]:
    """The rank processes among the launcher's descendants: spawned ones, or the children of
    the forkserver that forks them (not multiprocessing's resource tracker, nor the server)."""
    out = []
    for pid in ranks:
        try:
            cmd = _cmdline(pid)
            parent = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]
            forked = "forkserver import main" in cmd and "forkserver import main" in _cmdline(
                int(parent))
        except OSError:
            continue
        if "spawn_main" in cmd or forked:
            out.append(pid)
    return out


def baseline(tmp: Path, extra=()) -> tuple[Outcome, float]:
    run_dir = tmp / "baseline"
    run, left = usp_train(run_dir, extra)
    loss = final_loss(run_dir)
    ok = run.rc == 0 and math.isfinite(loss) and not left
    return Outcome("none (reference run)", f"rc {run.rc}, final loss {loss:.6f}, "
                   f"{run.seconds:.0f} s", 0, ok), loss


def sigterm(tmp: Path, ref: float, extra=(), at: int = 9) -> Outcome:
    """SIGTERM to usp-train (what Slurm and Kubernetes send before a kill), then a resume."""
    run_dir = tmp / "sigterm"
    act = _when_step(run_dir, at, lambda proc, ranks: proc.send_signal(signal.SIGTERM))
    run, left = usp_train(run_dir, extra, act)
    stopped, ckpts = last_step(run_dir), _checkpoints(run_dir)
    saved = ckpts[-1] if ckpts else 0
    again, left2 = usp_train(run_dir, extra)
    loss = final_loss(run_dir)
    ok = (run.rc == 75 and saved == stopped and again.rc == 0 and same_loss(loss, ref)
          and not left and not left2)
    return Outcome("SIGTERM to usp-train", f"rc {run.rc} after step {stopped}, checkpoint "
                   f"step {saved}; resumed: rc {again.rc}, final loss "
                   f"{'equal' if same_loss(loss, ref) else f'{loss:.6f} != {ref:.6f}'}",
                   stopped - saved, ok)


def kill_rank(tmp: Path, ref: float, extra=(), at: int = 9) -> Outcome:
    """SIGKILL one rank mid-run with trainer.max_restarts=1."""
    run_dir = tmp / "kill_rank"
    killed = {}

    def action(proc, ranks):
        pids = _rank_pids(ranks)
        killed["step"] = last_step(run_dir)
        os.kill(pids[-1], signal.SIGKILL)

    run, left = usp_train(run_dir, [*extra, "trainer.max_restarts=1"],
                          _when_step(run_dir, at, action))
    loss = final_loss(run_dir)
    restarts = (run.out + run.err).count("usp: restart")
    resumed = [ln for ln in run.out.splitlines() if ln.startswith("resumed from")]
    at = re.search(r" at step (\d+)", resumed[-1]) if resumed else None  # "... at step K (..."
    resumed_from = int(at.group(1)) if at else 0
    ok = run.rc == 0 and restarts == 1 and same_loss(loss, ref) and not left
    return Outcome("SIGKILL one rank, trainer.max_restarts=1",
                   f"killed after step {killed.get('step')}, {restarts} restart, rc {run.rc}, "
                   f"final loss {'equal' if same_loss(loss, ref) else f'{loss:.6f}'}",
                   killed.get("step", 0) - resumed_from, ok)


def corrupt_checkpoint(tmp: Path, ref: float, extra=()) -> Outcome:
    """The newest checkpoint garbled (same size) before a resume."""
    run_dir = tmp / "corrupt"
    first, _ = usp_train(run_dir, [*extra, "trainer.stop_after=14"])
    ckpts = _checkpoints(run_dir)
    newest = Path(run_dir) / "checkpoints" / f"step_{ckpts[-1]:06d}"
    shard = sorted(newest.glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one byte flipped: same size, wrong contents
    shard.write_bytes(bytes(data))
    again, left = usp_train(run_dir, extra)
    named = [ln for ln in (again.out + again.err).splitlines() if "damaged" in ln]
    loss = final_loss(run_dir)
    ok = (first.rc == 0 and again.rc == 0 and len(named) == 1 and newest.name in named[0]
          and same_loss(loss, ref) and not left)
    return Outcome("newest checkpoint garbled (one byte, same size)",
                   f"named in {len(named)} line, resumed from step {ckpts[-2] if len(ckpts) > 1 else 0}"
                   f", final loss {'equal' if same_loss(loss, ref) else f'{loss:.6f}'}",
                   ckpts[-1] - (ckpts[-2] if len(ckpts) > 1 else 0), ok)


def diverge(tmp: Path, extra=()) -> Outcome:
    """optim.lr=1e6: the loss turns NaN."""
    run_dir = tmp / "nan"
    run, left = usp_train(run_dir, [*extra, "optim.lr=1e6", "optim.min_lr=0"])
    line = (run.err.strip().splitlines() or [""])[-1]  # usp-train's own last line
    ckpts = _checkpoints(run_dir)
    recs = metrics(run_dir)
    finite = all(math.isfinite(r["loss"]) for r in recs)
    found = re.search(r"at step (\d+)", line)
    bad_step = int(found.group(1)) if found else None
    ok = (run.rc != 0 and "non-finite" in line and finite and not left
          and all(c < (bad_step or 0) for c in ckpts))
    said = re.search(r"non-finite \S+ \([^)]*\) at step \d+", line)
    return Outcome("optim.lr=1e6 (loss turns NaN)",
                   f"rc {run.rc}, one line: \"{said.group(0) if said else line[:80]}\"; "
                   f"checkpoints kept: {ckpts or 'none'}",
                   0, ok)


def stall_rank(tmp: Path, extra=(), at: int = 7, timeout_s: int = 15) -> Outcome:
    """SIGSTOP one rank (a hung peer) with trainer.timeout_s."""
    run_dir = tmp / "stall"
    t_stop = {}

    def action(proc, ranks):
        t_stop["t"] = time.perf_counter()
        t_stop["step"] = last_step(run_dir)
        os.kill(_rank_pids(ranks)[-1], signal.SIGSTOP)

    run, left = usp_train(run_dir, [*extra, f"trainer.timeout_s={timeout_s}"],
                          _when_step(run_dir, at, action), timeout=300)
    waited = time.perf_counter() - t_stop.get("t", time.perf_counter())
    line = (run.err.strip().splitlines() or [""])[-1]  # usp-train's own last line
    saved = (_checkpoints(run_dir) or [0])[-1]
    ok = (run.rc != 0 and "timed out" in line.lower() and "still running" in line
          and not left and waited < timeout_s + 60)
    named = re.search(r"collective on \S+ ranks \[[^\]]*\] timed out after \S+", line)
    running = re.search(r"ranks \[[^\]]*\] still running", line)
    return Outcome(f"one rank stopped (SIGSTOP), trainer.timeout_s={timeout_s}",
                   f"rc {run.rc}, {waited:.0f} s after the stop, one line: "
                   f"\"{named.group(0) if named else line[:80]}\" ... "
                   f"\"{running.group(0) if running else ''} ... were killed\"",
                   t_stop.get("step", 0) - saved, ok)


def changed_settings(tmp: Path, extra=()) -> Outcome:
    """Resume of a finished run with another learning rate."""
    run_dir = tmp / "baseline"  # the reference run's directory, complete
    run, left = usp_train(run_dir, [*extra, "optim.lr=1e-3"])
    line = (run.err.strip().splitlines() or [""])[-1]
    said = re.search(r"\(optim\.lr: [^)]*\)", line)
    ok = run.rc != 0 and said is not None and not left
    return Outcome("resume with a changed optim.lr",
                   f"rc {run.rc}, refused in one line naming {said.group(0) if said else line[:80]}",
                   0, ok)


SCENARIOS = ("sigterm", "kill_rank", "corrupt_checkpoint", "diverge", "stall_rank",
             "changed_settings")


def campaign(tmp: Path, names=SCENARIOS, extra=(), log=print) -> list[Outcome]:
    """The reference run, then each named scenario; returns the table's rows."""
    tmp = Path(tmp)
    ref_row, ref = baseline(tmp, extra)
    rows = [ref_row]
    log(format_row(ref_row))
    fns = {"sigterm": lambda: sigterm(tmp, ref, extra), "kill_rank": lambda: kill_rank(tmp, ref, extra),
           "corrupt_checkpoint": lambda: corrupt_checkpoint(tmp, ref, extra),
           "diverge": lambda: diverge(tmp, extra), "stall_rank": lambda: stall_rank(tmp, extra),
           "changed_settings": lambda: changed_settings(tmp, extra)}
    for name in names:
        row = fns[name]()
        rows.append(row)
        log(format_row(row))
    return rows


def format_row(o: Outcome) -> str:
    lost = "-" if o.steps_lost is None else str(o.steps_lost)
    return f"| {o.fault} | {o.happened} | {lost} | {'PASS' if o.ok else 'FAIL'} |"


def format_table(rows: list[Outcome]) -> str:
    head = "| fault | what happened | steps lost | verdict |\n|---|---|---|---|"
    return "\n".join([head, *(format_row(r) for r in rows)])
