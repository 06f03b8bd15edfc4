"""python -m usp.bench.gpu_check --dry-run: the GPU check's own code runs on the CPU, and can fail."""

import json
import subprocess
import sys
from pathlib import Path

import torch

from usp.bench import gpu_check, gpu_checks_attention
from usp.kernels import get_kernel

ROOT = Path(__file__).resolve().parent.parent


def test_dry_run_end_to_end(tmp_path):
    res = subprocess.run([sys.executable, "-m", "usp.bench.gpu_check", "--dry-run", "--out", str(tmp_path)],
                         capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["ok"] and report["dry_run"]
    counts = {name: len(rows) for name, rows in report["sections"].items()}
    # kernels: 2 dtypes x 3 head layouts x 1 head dim x 2 lengths x causal x strided
    assert counts == {"kernels": 48, "ring": 16, "usp_attention": 16, "training": 4,
                      "throughput": 2}
    layouts = {(r["ulysses"], r["ring"], r["a2a_chunks"])
               for r in report["sections"]["usp_attention"]}
    assert layouts == {(2, 2, 1), (1, 4, 1), (4, 1, 1), (2, 2, 2), (4, 1, 2)}
    for row in report["sections"]["usp_attention"]:  # every layout really communicated
        assert sum(row["bytes_rank0"].values()) > 0
    for row in report["sections"]["training"]:
        assert row["loss_last5"] < 0.8 * row["loss_first5"]
    assert "overall: PASS" in (tmp_path / "summary.txt").read_text()


class _Off:
    """The torch kernel with its output nudged: what a wrong CUDA call would look like."""

    def __init__(self, eps):
        self.inner, self.eps, self.name = get_kernel("torch"), eps, "off"

    def forward(self, q, k, v, causal, scale):
        out, lse = self.inner.forward(q, k, v, causal, scale)
        return out + self.eps, lse

    def backward(self, *args):
        return self.inner.backward(*args)


def test_the_check_fails_on_a_wrong_kernel(monkeypatch):
    sizes = gpu_check.Sizes.dry()
    monkeypatch.setattr(gpu_checks_attention, "get_kernel", lambda name: _Off(1e-4))
    rows = gpu_check.SECTIONS["kernels"](torch.device("cpu"), sizes)
    fp32 = [r for r in rows if r["dtype"] == "float32"]
    assert fp32 and not any(r["ok"] for r in fp32)  # 1e-4 > the 2e-5 fp32 bound
    monkeypatch.setattr(gpu_checks_attention, "get_kernel", lambda name: _Off(0.0))
    assert all(r["ok"] for r in gpu_check.SECTIONS["kernels"](torch.device("cpu"), sizes))
