"""The gpu tier: ``python -m usp.bench.gpu_check`` on the CUDA device, every section, as a test.

Skipped without CUDA (conftest.py). A GPU machine without Hydra runs this file alone:
``python -m pytest -q tests/gpu`` (collecting tests/unit would import Hydra).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_check_passes_every_section(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    res = subprocess.run([sys.executable, "-m", "usp.bench.gpu_check", "--out", str(tmp_path)],
                         capture_output=True, text=True, cwd=ROOT, env=env, timeout=570)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["ok"] and not report["dry_run"]
    failed = [(name, row) for name, rows in report["sections"].items()
              for row in rows if not row["ok"]]
    assert not failed and all(report["sections"].values()), failed[:5]
