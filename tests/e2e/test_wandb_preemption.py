"""Slurm's preemption with wandb on: ``scancel`` signals every process of the job step, the
wandb service (wandb-core, started by rank 0's ``wandb.init``) as well as the ranks. The
service dies at once; the run must still checkpoint its step, exit 75 and resume from it,
with one warning that wandb logging is off (``usp/train/metrics.py``)."""

import os
import re
import signal
from pathlib import Path

from tools.lab.faults import last_step, metrics, usp_train

# 2 ranks (ulysses 2), wandb offline (the default), no periodic checkpoint: the only one
# before the end is the preemption's
STEPS = 16
SMALL = ["parallel.ulysses_degree=2", "parallel.ring_degree=1", "trainer.nprocs=2",
         f"trainer.steps={STEPS}", "trainer.ckpt_every=0", "data.batch_per_dp_rank=2",
         "logging.wandb=offline"]
AT = 3  # the signals strike once this step is logged
# nothing of the run (ranks, wandb-core, wandb-symon) is alive this long after the launcher
GRACE = 1.0


def _wandb_core(pids: list[int]) -> list[int]:
    """The wandb service processes among ``pids``."""
    found = []
    for pid in pids:
        try:
            name = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            continue
        if name.startswith("wandb-core"):
            found.append(pid)
    return found


def test_sigterm_to_every_process_with_wandb_still_checkpoints(tmp_path):
    run_dir = tmp_path / "run"
    killed: list[int] = []

    def scancel(proc, pids):
        """Once step AT is logged: SIGTERM to the service and the launcher, as Slurm does."""
        core = _wandb_core(pids)
        if last_step(run_dir) < AT or not core:
            return False
        for pid in core:
            os.kill(pid, signal.SIGTERM)
        proc.send_signal(signal.SIGTERM)
        killed.extend(core)
        return True

    run, left = usp_train(run_dir, SMALL, scancel, timeout=120, grace=GRACE)
    out = run.out + run.err
    assert killed, "no wandb-core process was found under the launcher"
    assert run.rc == 75, out[-3000:]
    stopped = last_step(run_dir)  # the step the ranks agreed to stop at, checkpointed
    saved = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert saved == [f"step_{stopped:06d}"] and AT <= stopped < STEPS, (saved, stopped)
    warned = [ln for ln in out.splitlines() if "wandb failed" in ln]
    assert len(warned) == 1 and "metrics.jsonl keeps every metric" in warned[0], warned
    assert "Traceback" not in out, out[-3000:]
    assert not left  # no rank, no service and no monitor outlives the launcher

    again, left = usp_train(run_dir, SMALL, timeout=120, grace=GRACE)
    assert again.rc == 0, (again.out + again.err)[-3000:]
    assert "wandb failed" not in again.out + again.err  # a new service, logging again
    assert re.search(rf"resumed from \S+step_{stopped:06d} at step {stopped} ", again.out)
    assert [r["step"] for r in metrics(run_dir)] == list(range(1, STEPS + 1))  # none lost or twice
    assert not left
