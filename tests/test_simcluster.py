"""tools.simcluster (tools.lab.simcluster): a 2-node x 2-rank usp-train over shaped veth
links, and its refusals."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tools.lab.simcluster import SimCluster, SimClusterError, preflight, rate_to_bytes_per_s

ROOT = Path(__file__).resolve().parents[1]
TOOL = ["-m", "tools.simcluster"]  # run from the repository root

needs_root = pytest.mark.skipif(
    os.name != "posix" or os.geteuid() != 0 or shutil.which("ip") is None
    or shutil.which("tc") is None or shutil.which("unshare") is None,
    reason="simcluster needs root and ip/tc/unshare (network namespaces, veth, tc tbf)",
)


def _namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


@needs_root
def test_two_node_training_through_simcluster(tmp_path):
    before = _namespaces()
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
    leftover = {ns for ns in _namespaces() - before if ns.startswith("usp-")}
    assert not leftover, f"namespaces left behind: {leftover}"
    assert not any(Path("/etc/netns").glob("usp-*"))


@needs_root
def test_failing_command_returns_its_code_and_cleans_up(tmp_path):
    before = _namespaces()
    script = tmp_path / "fail.py"
    script.write_text("import os, sys\nsys.exit(3 if os.environ['RANK'] == '3' else 0)\n")
    p = subprocess.run([sys.executable, *TOOL, "--rate", "1gbit", "--timeout", "60", "--",
                        str(script)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode != 0, p.stdout + p.stderr
    assert not {ns for ns in _namespaces() - before if ns.startswith("usp-")}


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


def test_refuses_when_not_root():
    everything = {t: f"/usr/bin/{t}" for t in ("ip", "tc", "unshare")}
    with pytest.raises(SimClusterError, match="needs root"):
        preflight(euid=1000, which=everything.get)
    with pytest.raises(SimClusterError, match=r"missing: tc \("):
        preflight(euid=0, which={**everything, "tc": None}.get)
    preflight(euid=0, which=everything.get)  # root with every tool: no refusal


def test_rate_parsing():
    assert rate_to_bytes_per_s("1gbit") == 1.25e8
    assert rate_to_bytes_per_s("800mbit") == 1e8
    assert rate_to_bytes_per_s("50mbps") == 5e7
    with pytest.raises(ValueError, match="bad rate"):
        rate_to_bytes_per_s("fast")
    with pytest.raises(ValueError, match="bad rate 'fast'"):
        SimCluster(rate="fast")  # refused before any namespace exists


def test_queue_reaches_every_shaped_link_and_a_bad_one_is_refused(monkeypatch):
    import tools.lab.simcluster as sc
    from tools.lab.cluster import ClusterBench

    calls = []
    monkeypatch.setattr(sc, "_sh", lambda *args, **kw: calls.append(args))
    sc._tbf("ns", "eth0", "300mbit", "262144b", 30.0)
    assert calls[-1][-4:] == ("burst", "262144b", "latency", "30ms")
    assert SimCluster(queue_ms=30).queue_ms == 30 and SimCluster().queue_ms == 100
    with pytest.raises(ValueError, match="queue_ms must be > 0"):
        SimCluster(queue_ms=0)  # refused before any namespace exists
    with pytest.raises(ValueError, match="queue_ms must be > 0"):
        ClusterBench(queue_ms=-1.0)
