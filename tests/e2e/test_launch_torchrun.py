"""usp-train under torchrun (2 ranks, ring=auto): it trains, and rank 0 alone decides and
prints the plan."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun not on PATH")
def test_torchrun_end_to_end(tmp_path):
    run = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE"))}
    res = subprocess.run(
        ["torchrun", "--standalone", "--nproc-per-node", "2", "-m", "usp.cli",
         "parallel.ulysses_degree=1", "parallel.ring_degree=auto",
         "parallel.ranks_per_node=1",
         "trainer.steps=3", "data.seq_len=256", "logging=none", f"trainer.run_dir={run}",
         f"hydra.run.dir={tmp_path / 'hydra'}"],
        capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "done: step 3" in res.stdout
    assert res.stdout.count("plan: world 2") == 1  # ring=auto: decided and printed by rank 0 only
    assert (run / "checkpoints" / "step_000003" / "extra.pt").exists()


@pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun not on PATH")
def test_torchrun_refusal_is_said_once_before_any_process_group(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE"))}
    res = subprocess.run(
        ["torchrun", "--standalone", "--nproc-per-node", "2", "-m", "usp.cli",
         "parallel.ulysses_degree=3", "parallel.ring_degree=1", "logging=none",
         f"trainer.run_dir={tmp_path / 'run'}", f"hydra.run.dir={tmp_path / 'hydra'}"],
        capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert res.returncode != 0
    lines = [line for line in res.stderr.splitlines() if "usp-train: error:" in line]
    assert len(lines) == 1, res.stderr[-3000:]  # rank 0 says it for both tasks
    assert "ulysses" in lines[0] and lines[0].endswith("(all 2 tasks stop with this error)")
    assert "ValueError" not in res.stderr  # (torchrun adds its own ChildFailedError report)
