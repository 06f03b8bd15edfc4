"""Bring up a real 2-node Slurm cluster on this host (needs root, slurm-wlm and munge), run
one client command in it, or wait for Ctrl-C while you use it; tear everything down on exit.

slurmctld and one slurmd per node run in network namespaces of their own, munged on a unix
socket in the work directory (``tools.lab.slurmcluster``). With a command after ``--``, it
runs inside the controller's namespace with ``SLURM_CONF`` set (as a login node would);
then every job it submitted is waited for and its state and output printed. The exit code
is the command's if it failed, else 1 if a job did not complete, else 0. Everything is
removed on exit, including on errors, Ctrl-C, SIGTERM and SIGHUP.

    sudo python -m tools.slurmcluster -- sbatch -N2 --ntasks-per-node=2 --wrap 'srun hostname'
    sudo python -m tools.slurmcluster --nodes 2 --cpus 8   # up, says how to use it; Ctrl-C ends
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import sys
import time
from pathlib import Path

from tools.lab.simcluster import interrupt_on_signal
from tools.lab.slurmcluster import ENDED, SlurmCluster, SlurmClusterError, preflight


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        usage="%(prog)s [options] [-- command [args...]]")
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--cpus", type=int, default=8, help="CPUs (cores) per node as Slurm sees them")
    p.add_argument("--workdir", default=None,
                   help="slurm.conf, munge key, state and logs (default: a temporary directory, "
                        "removed on exit; a given one is kept)")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="with a command: wait at most this long for its jobs (s)")
    split = argv.index("--") if "--" in argv else len(argv)
    args, cmd = p.parse_args(argv[:split]), argv[split + 1:]
    if "--" in argv and not cmd:
        p.error("no command after `--`")
    return args, cmd


def usage_lines(cluster: SlurmCluster) -> list[str]:
    """How to reach the cluster from another shell while it is up."""
    prefix = f"ip netns exec {cluster.ctl_ns} env SLURM_CONF={cluster.conf}"
    return [f"nodes {', '.join(cluster.node_names)} idle; from another root shell:",
            f"  {prefix} sinfo",
            f"  {prefix} sbatch --nodes={cluster.nodes} --ntasks-per-node=2 --wrap 'srun hostname'",
            f"  {prefix} squeue",
            f"logs: {cluster.workdir / 'log'}; Ctrl-C tears the cluster down"]


def wait_for_jobs(cluster: SlurmCluster, timeout: float) -> list[dict]:
    """Every job's fields once all have ended; raise past ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        jobs = cluster.jobs()
        if all(j.get("JobState") in ENDED for j in jobs):
            return jobs
        if time.monotonic() > deadline:
            left = ", ".join(f"{j['JobId']} {j.get('JobState')}" for j in jobs
                             if j.get("JobState") not in ENDED)
            raise SlurmClusterError(f"jobs still not ended after {timeout:g} s: {left}\n"
                                    f"{cluster.logs()}")
        time.sleep(0.3)


def run_command(cluster: SlurmCluster, cmd: list[str], timeout: float) -> int:
    print(f"slurmcluster: $ {shlex.join(cmd)}", flush=True)
    rc = cluster.run(cmd, cwd=os.getcwd(), timeout=timeout, capture=False).returncode
    if rc:
        return rc
    failed = 0
    for j in wait_for_jobs(cluster, timeout):
        print(f"slurmcluster: job {j['JobId']} {j['JobState']} exit {j.get('ExitCode')} "
              f"on {j.get('NodeList')}, output {j.get('StdOut')}", flush=True)
        out = Path(j.get("StdOut", ""))
        if out.is_file():
            sys.stdout.write(out.read_text(errors="replace"))
            sys.stdout.flush()
        failed += j["JobState"] != "COMPLETED"
    return 1 if failed else 0


def main(argv=None) -> int:
    args, cmd = parse_args(sys.argv[1:] if argv is None else argv)
    old = {s: signal.signal(s, interrupt_on_signal) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        preflight()
        with SlurmCluster(args.nodes, args.cpus, args.workdir) as cluster:
            if cmd:
                return run_command(cluster, cmd, args.timeout)
            for line in usage_lines(cluster):
                print(f"slurmcluster: {line}", flush=True)
            try:
                while True:
                    signal.pause()
            except KeyboardInterrupt:
                return 0  # the way to end an interactive session
    except (SlurmClusterError, ValueError) as e:
        print(f"slurmcluster: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("slurmcluster: interrupted; cleaned up", file=sys.stderr)
        return 130
    finally:
        for s, h in old.items():
            signal.signal(s, h)


if __name__ == "__main__":
    sys.exit(main())
