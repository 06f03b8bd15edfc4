"""tools.train_table as root, at a tiny size: three rows (the planner's (2,2), DeepSpeed-
Ulysses (4,1), ring-only (1,4)) trained on a simulated 2-node x 2-rank cluster, every row
with tokens/s and the same loss, no namespace left behind. Its parts without root:
``unit/test_train_table.py``."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from _root import namespaces, needs_root

ROOT = Path(__file__).resolve().parents[2]


@needs_root
def test_tiny_table_has_three_rows_that_agree(tmp_path):
    pytest.importorskip("deepspeed")
    before = namespaces()
    out = tmp_path / "table"
    cmd = [sys.executable, "-m", "tools.train_table", "--seq-len", "256", "--layers", "1",
           "--dim", "256", "--ffn-dim", "768", "--warmup", "1", "--rounds", "2",
           "--timeout", "150", "--out", str(out)]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=200)
    text = p.stdout + p.stderr
    assert p.returncode == 0, text[-4000:]
    summary = json.loads((out / "results.json").read_text())["summary"]
    rows = summary["rows"]
    assert [(r["attention"], r["ulysses"], r["ring"]) for r in rows] == \
        [("usp", 2, 2), ("deepspeed", 4, 1), ("usp", 1, 4)]
    assert all(r["tokens_per_s"] > 0 and len(r["step_s"]) == 2 for r in rows)
    assert all(r["predicted_s"] > 0 for r in rows)
    assert summary["loss_rel_diff"] <= 1e-4 and summary["every_token_rel_diff"] <= 1e-4
    assert summary["grad_norm_rel_diff"] <= 1e-3
    assert len(set(summary["hosts"])) == 2  # two simulated nodes, seen by their host names
    printed = [ln for ln in p.stdout.splitlines()
               if ln.lstrip().startswith(("planner's choice", "all-ulysses", "ring-only"))]
    assert len(printed) == 3, p.stdout[-3000:]
    assert (out / "table.txt").read_text().count("(2,2)") >= 1
    assert not {ns for ns in namespaces() - before if ns.startswith("usp-")}
