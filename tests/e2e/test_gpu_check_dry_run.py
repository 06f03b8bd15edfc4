"""python -m usp.bench.gpu_check --dry-run: the GPU check's own code runs on the CPU, every
section, and passes.

The command is the module's ``main`` with the same arguments, in a fresh interpreter, with one
change: the training section's runs take TRAIN_STEPS steps instead of the dry run's 20 (its
four runs were most of the test's time). Their loss still has to fall below 0.8x its start:
measured at 12 steps 5.471 -> 3.914 (0.715x) in each of the four runs, at 20 steps 0.46x.
The fifth training row is the state offload's check (``check_state_offload``), 3 AdamW steps.
"""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TRAIN_STEPS = 12  # > the training section's 10 warm-up steps
# `python -m usp.bench.gpu_check ARGS`, the dry run's training steps set to TRAIN_STEPS
COMMAND = f"""
import sys
from dataclasses import replace
from usp.bench import gpu_check
dry = gpu_check.Sizes.dry
gpu_check.Sizes.dry = classmethod(lambda cls: replace(dry(), train_steps={TRAIN_STEPS}))
sys.exit(gpu_check.main(sys.argv[1:]))
"""


def test_dry_run_end_to_end(tmp_path):
    res = subprocess.run([sys.executable, "-c", COMMAND, "--dry-run", "--out", str(tmp_path)],
                         capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["ok"] and report["dry_run"]
    counts = {name: len(rows) for name, rows in report["sections"].items()}
    # kernels: 2 dtypes x 3 head layouts x 1 head dim x 2 lengths x causal x strided;
    # ring: 2 dtypes x r 2, 4 x 2 balances x causal, and head groups: 2 dtypes x r 1, 2 x causal
    assert counts == {"kernels": 48, "ring": 24, "usp_attention": 16, "experts": 4,
                      "training": 5, "throughput": 2}
    assert sum(r["head_groups"] for r in report["sections"]["ring"]) == 8
    assert {(r["degree"], r["dtype"]) for r in report["sections"]["experts"]} == {
        (2, "float32"), (4, "float32"), (2, "bfloat16"), (4, "bfloat16")}
    layouts = {(r["ulysses"], r["ring"], r["a2a_chunks"])
               for r in report["sections"]["usp_attention"]}
    assert layouts == {(2, 2, 1), (1, 4, 1), (4, 1, 1), (2, 2, 2), (4, 1, 2)}
    for row in report["sections"]["usp_attention"]:  # every layout really communicated
        assert sum(row["bytes_rank0"].values()) > 0
    *runs, state = report["sections"]["training"]
    assert state["losses_match"] and state["state_on_host"] and state["steps"] == 3
    for row in runs:
        assert row["steps"] == TRAIN_STEPS
        assert row["loss_last5"] < 0.8 * row["loss_first5"]
    assert "overall: PASS" in (tmp_path / "summary.txt").read_text()
