"""tools.slurmcluster (tools.lab.slurmcluster), as root with slurm-wlm and munge: two idle nodes,
a 2 x 2 job's host names, two such jobs side by side, requeue + release, drain, a signal to
the batch script, the CLI, and nothing left behind; without root only the preflight."""

import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest

from tools.lab.slurmcluster import SlurmCluster, SlurmClusterError, parse_fields, preflight

ROOT = Path(__file__).resolve().parents[2]
TOOL = [sys.executable, "-m", "tools.slurmcluster"]  # run from the repository root


def test_preflight_names_what_is_missing():
    tools = ("ip", "unshare", "slurmctld", "slurmd", "munged", "sbatch", "squeue", "scontrol",
             "scancel", "srun", "sinfo")
    everything = {t: f"/usr/bin/{t}" for t in tools}
    with pytest.raises(SlurmClusterError, match="needs root"):
        preflight(euid=1000, which=everything.get)
    with pytest.raises(SlurmClusterError, match=r"missing: slurmd, sbatch \(Debian/Ubuntu: "
                                                r"apt-get install slurm-wlm\)"):
        preflight(euid=0, which={**everything, "slurmd": None, "sbatch": None}.get)
    with pytest.raises(SlurmClusterError, match=r"missing: munged \(.*apt-get install munge\)"):
        preflight(euid=0, which={**everything, "munged": None}.get)
    with pytest.raises(SlurmClusterError, match="apt-get install slurm-wlm munge"):
        preflight(euid=0, which=lambda t: None if t in ("srun", "munged") else everything[t])
    preflight(euid=0, which=everything.get)  # root with every program: no refusal
    with pytest.raises(ValueError, match="need nodes >= 1"):
        SlurmCluster(nodes=0)  # refused before any namespace exists


def test_scontrol_lines_parse_into_fields():
    line = ("JobId=7 JobName=wrap JobState=PENDING Reason=BeginTime Dependency=(null) "
            "TRES=cpu=4,node=2,billing=4 Comment=two words StdOut=/tmp/slurm-7.out")
    f = parse_fields(line)
    assert f["JobId"] == "7" and f["JobState"] == "PENDING" and f["Reason"] == "BeginTime"
    assert f["TRES"] == "cpu=4,node=2,billing=4" and f["Comment"] == "two words"
    assert f["StdOut"] == "/tmp/slurm-7.out"


def test_two_nodes_come_up_idle(slurm_cluster):
    assert slurm_cluster.node_states() == {"node0": "idle", "node1": "idle"}
    assert slurm_cluster.up_seconds < 10, slurm_cluster.up_seconds


def test_a_2x2_job_runs_on_both_nodes(slurm_cluster):
    job = slurm_cluster.sbatch(["--nodes=2", "--ntasks-per-node=2", "--wrap", "srun hostname"])
    info = slurm_cluster.wait(job, timeout=60)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", info
    # each node's slurmd forks its tasks inside the node's namespace: its own host name
    assert sorted(slurm_cluster.output(job).split()) == ["node0", "node0", "node1", "node1"]


def test_two_2x2_jobs_run_side_by_side(slurm_cluster, tmp_path):
    # each task waits for its twin in the other job: both complete only if they overlap
    wait_for = ('touch {d}/{me}.$SLURM_PROCID; i=0; while [ ! -e {d}/{other}.$SLURM_PROCID ]; '
                'do i=$((i+1)); [ $i -gt 300 ] && exit 3; sleep 0.1; done')
    jobs = [slurm_cluster.sbatch(["--nodes=2", "--ntasks-per-node=2", "--wrap", f"srun sh -c '"
                                  f"{wait_for.format(d=tmp_path, me=me, other=other)}'"])
            for me, other in (("a", "b"), ("b", "a"))]
    for job in jobs:
        info = slurm_cluster.wait(job, timeout=90)
        assert info["JobState"] == "COMPLETED" and info["NodeList"] == "node[0-1]", info
    assert len(list(tmp_path.glob("[ab].[0-3]"))) == 8


def test_a_requeued_job_is_held_until_released(slurm_cluster):
    job = slurm_cluster.sbatch(["--nodes=2", "--ntasks-per-node=1", "--wrap", "srun sleep 60"])
    slurm_cluster.wait_running(job, timeout=60)
    slurm_cluster.requeue(job)
    info = slurm_cluster.wait(job, ("PENDING",), timeout=60)
    assert info["Reason"] == "BeginTime" and info["Restarts"] == "1", info
    held = datetime.fromisoformat(info["StartTime"]) - datetime.now()
    assert held.total_seconds() > 60, info  # Slurm holds a requeued job ~120 s
    t0 = time.monotonic()
    slurm_cluster.release(job)
    slurm_cluster.wait_running(job, timeout=15)
    assert time.monotonic() - t0 < 5
    slurm_cluster.cancel(job)
    assert slurm_cluster.wait(job, timeout=60)["JobState"] == "CANCELLED"


def test_a_drained_node_keeps_a_2_node_job_pending(slurm_cluster):
    slurm_cluster.drain("node1", "test")
    try:
        assert slurm_cluster.node_states()["node1"] == "drain"
        job = slurm_cluster.sbatch(["--nodes=2", "--wrap", "true"])
        time.sleep(2.0)  # two scheduling passes
        assert slurm_cluster.job(job)["JobState"] == "PENDING"
    finally:
        slurm_cluster.resume("node1")
    assert slurm_cluster.wait(job, timeout=60)["JobState"] == "COMPLETED"


def test_a_signal_reaches_the_batch_script(slurm_cluster):
    script = "#!/bin/bash\ntrap 'echo got USR1; exit 0' USR1\nwhile :; do sleep 0.1; done\n"
    job = slurm_cluster.sbatch(script, "--nodes=1")
    slurm_cluster.wait_running(job, timeout=60)
    time.sleep(0.5)  # the trap is set
    slurm_cluster.signal(job, "USR1", batch=True)
    info = slurm_cluster.wait(job, timeout=30)
    assert info["JobState"] == "COMPLETED", info
    assert "got USR1" in slurm_cluster.output(job)


def _namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def test_close_leaves_nothing_behind(slurm_cluster):
    # a second cluster beside the module's, closed with a job still running
    cluster = SlurmCluster(nodes=2, log=None)
    with cluster:
        workdir, names = cluster.workdir, set(cluster.namespaces)
        job = cluster.sbatch(["--nodes=2", "--wrap", "srun sleep 300"])
        cluster.wait_running(job, timeout=60)
        pids = {int(p) for ns in names for p in subprocess.run(
            ["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()}
        pids |= {p.pid for _, p in cluster._daemons}  # munged lives in the root namespace
        assert len(pids) >= 6, pids  # slurmctld, 2 slurmd, slurmstepd, sleep, munged
    assert not names & _namespaces()
    assert not [p for p in pids if _alive(p)]
    assert not any(Path("/etc/netns", ns).exists() for ns in names)
    assert not workdir.exists()
    assert slurm_cluster.node_states() == {"node0": "idle", "node1": "idle"}  # untouched


def test_the_command_line_runs_a_job_and_cleans_up_on_sigterm(slurm_cluster, tmp_path):
    before = _namespaces()
    p = subprocess.run([*TOOL, "--", "sbatch", "--nodes=2", "--ntasks-per-node=2", "--chdir",
                        str(tmp_path), "--wrap", "srun hostname"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "COMPLETED exit 0:0 on node[0-1]" in p.stdout, p.stdout
    assert sorted(p.stdout.split("\n")[-6:-2]) == ["node0", "node0", "node1", "node1"], p.stdout
    # interactive use: up until SIGTERM, then torn down
    idle = subprocess.Popen(TOOL, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        for line in idle.stdout:
            if "Ctrl-C tears the cluster down" in line:
                break
        assert len(_namespaces() - before) == 4
        idle.send_signal(signal.SIGTERM)
        assert idle.wait(timeout=30) == 0, idle.stdout.read()
    finally:
        if idle.poll() is None:
            idle.kill()
    assert _namespaces() - before == set()
    assert not list(ROOT.glob("slurm-*.out"))  # the job wrote to its --chdir
