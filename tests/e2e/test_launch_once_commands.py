"""usp-train with trainer.device=cuda on a machine without a GPU refuses in one line, before
spawning anything."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def test_usp_train_refuses_cuda_without_gpu(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "SLURM"))}
    res = subprocess.run(
        [sys.executable, "-c", "from usp.cli import train_main; train_main()",
         "trainer.device=cuda", f"hydra.run.dir={tmp_path}"],
        capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert res.returncode != 0
    assert "usp-train: error: trainer.device=cuda but this process sees 0 CUDA GPUs" in res.stderr
    assert "Traceback" not in res.stderr and "SPMesh" not in res.stdout  # nothing was spawned
