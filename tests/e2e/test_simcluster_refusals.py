"""python -m tools.simcluster refuses with status 2 when root or its tools are missing."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOOL = ["-m", "tools.simcluster"]  # run from the repository root


def test_refuses_when_tc_is_missing(tmp_path):
    if shutil.which("ip") is None:
        pytest.skip("no `ip` on this machine: nothing to put on the fake PATH")
    (tmp_path / "ip").symlink_to(shutil.which("ip"))  # PATH has ip, but no tc
    env = dict(os.environ, PATH=str(tmp_path))
    p = subprocess.run([sys.executable, *TOOL, "--", "-m", "usp.cli"], env=env, cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2, p.stdout + p.stderr
    # root is checked first: as root the message names the missing tools, else root
    want = "missing: tc, unshare" if os.geteuid() == 0 else "needs root"
    assert want in p.stderr, p.stderr
