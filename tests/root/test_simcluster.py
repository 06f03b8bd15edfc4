"""tools.simcluster (tools.lab.simcluster), as root: a 2-node x 2-rank usp-train over shaped
veth links, and a failing command's code, with no namespace left behind. Its checks
without root: ``unit/test_simcluster_checks.py``, ``e2e/test_simcluster_refusals.py``."""

import subprocess
import sys
from pathlib import Path

from _root import namespaces, needs_root

ROOT = Path(__file__).resolve().parents[2]
TOOL = ["-m", "tools.simcluster"]  # run from the repository root


@needs_root
def test_two_node_training_through_simcluster(tmp_path):
    before = namespaces()
    cmd = [sys.executable, *TOOL, "--nodes", "2", "--nproc-per-node", "2",
           "--rate", "1gbit", "--timeout", "120", "--",
           "-m", "usp.cli", "trainer.steps=3", "data.seq_len=256", "logging=none",
           "parallel.ranks_per_node=null",  # real host names: one per namespace
           f"trainer.run_dir={tmp_path / 'run'}", f"hydra.run.dir={tmp_path / 'run'}"]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=180)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-4000:]
    assert "done: step 3" in out, out[-4000:]
    # the mesh found two hosts by all-gathering host names (UTS namespace per node)
    node_lines = [ln for ln in out.splitlines() if "-node0: r0(" in ln or "-node1: r2(" in ln]
    assert len(node_lines) == 2, out[-4000:]
    leftover = {ns for ns in namespaces() - before if ns.startswith("usp-")}
    assert not leftover, f"namespaces left behind: {leftover}"
    assert not any(Path("/etc/netns").glob("usp-*"))


@needs_root
def test_failing_command_returns_its_code_and_cleans_up(tmp_path):
    before = namespaces()
    script = tmp_path / "fail.py"
    script.write_text("import os, sys\nsys.exit(3 if os.environ['RANK'] == '3' else 0)\n")
    p = subprocess.run([sys.executable, *TOOL, "--rate", "1gbit", "--timeout", "60", "--",
                        str(script)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode != 0, p.stdout + p.stderr
    assert not {ns for ns in namespaces() - before if ns.startswith("usp-")}
