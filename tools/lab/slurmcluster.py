"""A real Slurm cluster on one Linux host: slurmctld and one slurmd per node, each in its own
network namespace, for testing usp under a real ``sbatch``/``srun``.

Every node is a network namespace with its own UTS host name (``hostname`` in a job prints
``node0``, ``node1``, ...) where a ``slurmd`` runs; ``slurmctld`` runs in a namespace of its
own (``ctl``). All of them hang on a bridge in a "switch" namespace, as in
``tools.lab.simcluster``, on a private subnet seen only inside the namespaces::

    ctl ns [slurmctld, 10.78.0.254] --veth-- switch ns [br0] --veth-- node0 ns [slurmd, 10.78.0.1]

``munged`` runs in the root namespace on a unix socket in the work directory (unix sockets
cross network namespaces; the system's munge is never touched), with a key of its own.
``slurm.conf`` and ``cgroup.conf`` sit in the work directory too; the daemons read them with
``-f`` and every client gets ``SLURM_CONF``. Client commands (``sbatch``, ``squeue``,
``scontrol``, ``scancel``, ``srun``) run inside ``ctl``; batch jobs run where slurmd forks
them, inside the node namespaces. ``close`` (on leaving the ``with`` block, on errors and on
``KeyboardInterrupt``) stops the daemons, kills anything left in the namespaces and deletes
them::

    with SlurmCluster(nodes=2) as cluster:
        job = cluster.sbatch(["--nodes=2", "--ntasks-per-node=2", "--wrap", "srun hostname"])
        assert cluster.wait(job)["JobState"] == "COMPLETED"
        print(cluster.output(job))
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from tools.lab.simcluster import remove_etc_dirs, say

DAEMONS = ("slurmctld", "slurmd", "munged")
CLIENTS = ("sbatch", "squeue", "scontrol", "scancel", "srun", "sinfo")
REQUIRED_TOOLS = ("ip", "unshare", *DAEMONS, *CLIENTS)
SUBNET = "10.78.0"  # private /24, only inside the namespaces (simcluster uses 10.77.0)
CTL_IP = f"{SUBNET}.254"
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "PREEMPTED", "NODE_FAIL",
         "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE")
POLL_S = 0.3
TEARDOWN_SIGNALS = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}


class SlurmClusterError(RuntimeError):
    """The host cannot run the Slurm cluster (not root, slurm or munge missing), set-up failed,
    or a job did not reach the state waited for in time."""


def preflight(euid: int | None = None, which: Callable[[str], str | None] = shutil.which) -> None:
    """Raise ``SlurmClusterError`` naming what is missing: root, ``ip``/``unshare``, or the
    Slurm and munge programs. ``euid`` and ``which`` are the probes, injectable for tests."""
    if (os.geteuid() if euid is None else euid) != 0:
        raise SlurmClusterError(
            "slurmcluster needs root (it creates network namespaces and runs slurmctld, slurmd "
            "and munged as root); run it as root, e.g. `sudo -E python -m tools.slurmcluster`")
    missing = [t for t in REQUIRED_TOOLS if which(t) is None]
    if missing:
        slurm = [t for t in missing if t not in ("ip", "unshare")]
        packages = [package for package, needed in (
            ("iproute2", "ip" in missing), ("util-linux", "unshare" in missing),
            ("slurm-wlm", any(t != "munged" for t in slurm)), ("munge", "munged" in missing))
            if needed]
        raise SlurmClusterError(f"slurmcluster needs {', '.join(REQUIRED_TOOLS)} on PATH; "
                                f"missing: {', '.join(missing)} (Debian/Ubuntu: apt-get install "
                                f"{' '.join(packages)})")


def parse_fields(line: str) -> dict[str, str]:
    """``scontrol show -o`` text -> {key: value}: ``JobId=5 JobName=wrap JobState=RUNNING ...``.

    A value runs up to the next `` Key=`` (values such as ``TRES=cpu=4,node=2`` keep their
    inner ``=``; a value with a space, like ``Reason=Not responding``, stays whole)."""
    keys = list(re.finditer(r"(?:^|(?<=\s))([A-Za-z][\w/:]*)=", line.strip()))
    text = line.strip()
    return {m.group(1): text[m.end():(keys[i + 1].start() if i + 1 < len(keys) else None)].strip()
            for i, m in enumerate(keys)}


def _sh(*args: str, check: bool = True, timeout: float = 10.0) -> subprocess.CompletedProcess:
    """Run one ip command; a failure raises with the command and its stderr."""
    p = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    if check and p.returncode:
        raise SlurmClusterError(f"`{' '.join(args)}` failed: {p.stderr.strip()}")
    return p


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


class SlurmCluster:
    """Context manager: slurmctld + ``nodes`` slurmd, each in a network namespace; jobs by sbatch.

    ``cpus``: CPUs (= cores) of each node as Slurm sees them (``config_overrides``: more than the
    host has is fine); with the default 8, two jobs of 2 nodes x 2 tasks run side by side.
    ``workdir``: where slurm.conf, the munge key, state, spool and logs go (default: a fresh
    temporary directory, removed on close; a given one is kept). ``log``: where set-up lines
    go; None: nowhere.
    """

    def __init__(self, nodes: int = 2, cpus: int = 8, workdir: str | Path | None = None,
                 log: Callable[[str], None] | None = say):
        if nodes < 1 or cpus < 1:
            raise ValueError(f"need nodes >= 1 and cpus >= 1, got {nodes} and {cpus}")
        if nodes > 200:
            raise ValueError(f"at most 200 nodes fit the /24 subnet, got {nodes}")
        self.nodes, self.cpus, self.log = nodes, cpus, log
        self._own_workdir = workdir is None
        self.workdir = Path(workdir) if workdir is not None else None
        self.tag = secrets.token_hex(3)  # per-run suffix: concurrent clusters never clash
        self.namespaces: list[str] = []  # every namespace created, for clean-up
        self._daemons: list[tuple[str, subprocess.Popen]] = []
        self._etc_dirs: list[Path] = []
        self.up_seconds = 0.0

    # ---- names --------------------------------------------------------------------------
    @property
    def node_names(self) -> list[str]:
        return [f"node{i}" for i in range(self.nodes)]

    def node_ns(self, i: int) -> str:
        return f"usp-s{self.tag}-n{i}"

    @property
    def ctl_ns(self) -> str:
        return f"usp-s{self.tag}-ctl"

    @property
    def switch_ns(self) -> str:
        return f"usp-s{self.tag}-sw"

    def node_ip(self, i: int) -> str:
        return f"{SUBNET}.{i + 1}"

    @property
    def conf(self) -> Path:
        return self.workdir / "slurm.conf"

    @property
    def munge_socket(self) -> Path:
        return self.workdir / "munge" / "munge.socket"

    @property
    def jobs_dir(self) -> Path:
        """The default working directory of jobs (their ``slurm-<id>.out`` land here)."""
        return self.workdir / "jobs"

    # ---- set-up / tear-down -------------------------------------------------------------
    def __enter__(self) -> SlurmCluster:
        self.up()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def up(self) -> None:
        """Create the namespaces, start munged, slurmctld and every slurmd; return once every
        node is idle. A failure (or Ctrl-C) on the way tears down what was made."""
        preflight()
        t0 = time.monotonic()
        try:
            self._make_workdir()
            self._make_network()
            self._start_munge()
            self._start_slurm()
        except BaseException:
            self.close()
            raise
        self.up_seconds = time.monotonic() - t0
        self._say(f"{self.nodes} nodes x {self.cpus} CPUs idle in {self.up_seconds:.1f} s; "
                  f"SLURM_CONF={self.conf}, clients in namespace {self.ctl_ns}")

    def _make_workdir(self) -> None:
        if self.workdir is None:
            self.workdir = Path(tempfile.mkdtemp(prefix="usp-slurm-"))
        for sub in ("munge", "state", "spool", "log", "jobs"):
            (self.workdir / sub).mkdir(parents=True, exist_ok=True)
        if len(str(self.munge_socket)) > 100:  # sun_path holds 108 bytes
            raise SlurmClusterError(f"work directory path too long for munge's unix socket "
                                    f"({self.munge_socket}); pass a shorter workdir")
        key = self.workdir / "munge" / "munge.key"
        key.write_bytes(secrets.token_bytes(1024))
        key.chmod(0o600)
        self.conf.write_text(self.slurm_conf())
        (self.workdir / "cgroup.conf").write_text(
            "CgroupPlugin=cgroup/v1\nCgroupAutomount=no\nConstrainCores=no\n"
            "ConstrainDevices=no\nConstrainRAMSpace=no\nConstrainSwapSpace=no\n")

    def slurm_conf(self) -> str:
        """The cluster's slurm.conf: root daemons, munge on our socket, no cgroups, no
        accounting; finished jobs stay visible for 600 s; requeue allowed."""
        w = self.workdir
        nodes = "\n".join(
            f"NodeName={n} NodeAddr={self.node_ip(i)} NodeHostname={n} CPUs={self.cpus} "
            f"Boards=1 SocketsPerBoard=1 CoresPerSocket={self.cpus} ThreadsPerCore=1 "
            f"RealMemory=1000 State=UNKNOWN" for i, n in enumerate(self.node_names))
        return f"""\
ClusterName=usp
SlurmctldHost=ctl({CTL_IP})
SlurmUser=root
SlurmdUser=root
SlurmctldPort=6817
SlurmdPort=6818
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.munge_socket}
StateSaveLocation={w}/state
SlurmdSpoolDir={w}/spool/%n
SlurmctldPidFile={w}/log/slurmctld.pid
SlurmdPidFile={w}/log/slurmd-%n.pid
SlurmctldLogFile={w}/log/slurmctld.log
SlurmdLogFile={w}/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
SlurmdParameters=config_overrides
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/backfill
SchedulerParameters=batch_sched_delay=0
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
JobRequeue=1
MinJobAge=600
SlurmdTimeout=30
MessageTimeout=10
KillWait=30
InactiveLimit=0
MailProg=/bin/true
{nodes}
PartitionName=main Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
"""

    def _make_network(self) -> None:
        sw = self.switch_ns
        self._add_ns(sw)
        _sh("ip", "-n", sw, "link", "add", "br0", "type", "bridge")
        _sh("ip", "-n", sw, "link", "set", "br0", "up")
        members = [(self.ctl_ns, CTL_IP, "c")] + [(self.node_ns(i), self.node_ip(i), f"n{i}")
                                                   for i in range(self.nodes)]
        for ns, ip, short in members:
            host_end, ns_end = f"s{self.tag}h{short}", f"s{self.tag}{short}"
            self._add_ns(ns)
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
            _sh("ip", "link", "add", host_end, "type", "veth", "peer", "name", ns_end)
            # both ends leave the root namespace at once
            _sh("ip", "link", "set", host_end, "netns", sw)
            _sh("ip", "link", "set", ns_end, "netns", ns)
            _sh("ip", "-n", ns, "link", "set", ns_end, "name", "eth0")
            _sh("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", "eth0")
            _sh("ip", "-n", ns, "link", "set", "eth0", "up")
            _sh("ip", "-n", sw, "link", "set", host_end, "master", "br0")
            _sh("ip", "-n", sw, "link", "set", host_end, "up")
        # /etc/netns/<ns>/hosts: `ip netns exec` mounts it over /etc/hosts in that namespace
        hosts = "\n".join(["127.0.0.1 localhost", f"{CTL_IP} ctl"]
                          + [f"{self.node_ip(i)} {n}" for i, n in enumerate(self.node_names)])
        for ns, _, _ in members:
            d = Path("/etc/netns", ns)
            d.mkdir(parents=True, exist_ok=True)
            self._etc_dirs.append(d)
            (d / "hosts").write_text(hosts + "\n")

    def _add_ns(self, name: str) -> None:
        _sh("ip", "netns", "add", name)
        self.namespaces.append(name)

    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen:
        out = open(self.workdir / "log" / f"{name}.out", "ab")
        try:
            p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out,
                                 stderr=subprocess.STDOUT, cwd=self.workdir,
                                 env=self.client_env(), start_new_session=True)
        finally:
            out.close()
        self._daemons.append((name, p))
        return p

    def _start_munge(self) -> None:
        m = self.workdir / "munge"
        self._spawn("munged", ["munged", "-F", "--force", f"--socket={self.munge_socket}",
                               f"--key-file={m / 'munge.key'}", f"--pid-file={m / 'munged.pid'}",
                               f"--log-file={m / 'munged.log'}",
                               f"--seed-file={m / 'munged.seed'}"])
        self._until(lambda: self.munge_socket.exists(), 10.0, "munged to open its socket")

    def _start_slurm(self) -> None:
        conf = str(self.conf)
        self._spawn("slurmctld", self._in_ns(self.ctl_ns, "ctl",  # SlurmctldHost's name
                                             ["slurmctld", "-D", "-c", "-i", "-f", conf]))
        self._until(lambda: self.run(["scontrol", "ping"], timeout=10).stdout.count("UP") > 0,
                    30.0, "slurmctld to answer `scontrol ping`")
        for i, name in enumerate(self.node_names):
            self._spawn(f"slurmd-{name}", self._in_ns(self.node_ns(i), name,
                                                      ["slurmd", "-D", "-f", conf, "-N", name]))
        self._until(lambda: set(self.node_states().values()) == {"idle"}, 30.0,
                    f"nodes {', '.join(self.node_names)} to be idle")

    @staticmethod
    def _in_ns(ns: str, hostname: str, argv: list[str]) -> list[str]:
        """``argv`` in network namespace ``ns`` and a UTS namespace of its own named
        ``hostname`` (slurmctld checks it against SlurmctldHost; ``hostname`` in a job prints
        its node's name)."""
        return ["ip", "netns", "exec", ns, "unshare", "--uts", "--",
                "sh", "-c", 'hostname "$0" && exec "$@"', hostname, *argv]

    def _until(self, ready: Callable[[], bool], timeout: float, what: str,
               poll: float = 0.05) -> None:
        """Poll ``ready`` until true; a daemon that died or the deadline raises with the logs."""
        deadline = time.monotonic() + timeout
        while not ready():
            dead = [f"{n} (exit {p.returncode})" for n, p in self._daemons if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                why = f"{', '.join(dead)} exited" if dead else f"timed out after {timeout:g} s"
                raise SlurmClusterError(f"waiting for {what}: {why}\n{self.logs()}")
            time.sleep(poll)

    def close(self) -> None:
        """Cancel every job, stop slurmd (and every job process), slurmctld and munged; delete
        the namespaces and their /etc/netns files. Bounded: never hangs."""
        if not (self.namespaces or self._daemons or self._etc_dirs or self._own_workdir
                and self.workdir is not None):
            return
        # a second Ctrl-C/SIGTERM waits until the teardown is done (then it is raised)
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, TEARDOWN_SIGNALS)
        try:
            self._close()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)

    def _close(self) -> None:
        t0 = time.monotonic()
        if self.namespaces and any(n == "slurmctld" and p.poll() is None
                                   for n, p in self._daemons):
            try:
                self.run(["scancel", "--user=root"], timeout=5)
            except (subprocess.TimeoutExpired, OSError):
                pass
        # the nodes first (slurmd, slurmstepd, job processes), then slurmctld, then munged
        self._kill_namespaces([self.node_ns(i) for i in range(self.nodes)])
        self._kill_namespaces([self.ctl_ns])
        for _, p in self._daemons:  # munged, and anything that left its namespace
            _stop(p)
        self._daemons.clear()
        self._kill_namespaces(self.namespaces, grace=0.0)  # a stray that came back
        for ns in reversed(self.namespaces):
            _sh("ip", "netns", "del", ns, check=False)
        self.namespaces.clear()
        remove_etc_dirs(self._etc_dirs)
        if self._own_workdir and self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir = None
        self._say(f"torn down in {time.monotonic() - t0:.1f} s")

    def _kill_namespaces(self, namespaces: list[str], grace: float = 3.0) -> None:
        """SIGTERM every process in these network namespaces at once; SIGKILL what is left
        after ``grace`` s; reap our own children among them."""
        namespaces = [ns for ns in namespaces if ns in self.namespaces]
        for sig in ((signal.SIGTERM, signal.SIGKILL) if grace else (signal.SIGKILL,)):
            pids = [int(p) for ns in namespaces
                    for p in _sh("ip", "netns", "pids", ns, check=False).stdout.split()]
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + (grace if sig == signal.SIGTERM else 2.0)
            while pids and time.monotonic() < deadline:
                for _, p in self._daemons:
                    p.poll()  # reap: a zombie child would count as alive
                pids = [pid for pid in pids if _alive(pid)]
                time.sleep(0.05)
            if not pids:
                return

    # ---- clients ------------------------------------------------------------------------
    def client_env(self, env: dict | None = None) -> dict:
        """The client's environment: ``env`` (default: ours) without the SLURM_* variables of
        an enclosing job, with SLURM_CONF and this Python's bin first on PATH (sbatch exports
        it to the job)."""
        base = {k: v for k, v in (os.environ if env is None else env).items()
                if not k.startswith("SLURM_")}
        bin_dir = str(Path(sys.executable).parent)
        path = base.get("PATH", os.defpath)
        if path.split(os.pathsep)[0] != bin_dir:
            path = bin_dir + os.pathsep + path
        base.update(PATH=path)
        if self.workdir is not None:
            base["SLURM_CONF"] = str(self.conf)
        return base

    def client(self, args: Sequence[str]) -> list[str]:
        """``args`` as a command line that runs inside the client namespace (for a long-running
        client such as a submitter, started with ``subprocess.Popen(..., env=client_env())``)."""
        return ["ip", "netns", "exec", self.ctl_ns, *args]

    def run(self, args: Sequence[str], env: dict | None = None, cwd: str | Path | None = None,
            timeout: float | None = 30.0, capture: bool = True) -> subprocess.CompletedProcess:
        """Run one client command (``["squeue", "-h"]``) inside the ctl namespace with
        SLURM_CONF set; output captured as text unless ``capture`` is False. ``cwd``
        defaults to ``jobs_dir``."""
        if not self.namespaces:
            raise SlurmClusterError("SlurmCluster.run needs the cluster up (use `with`)")
        return subprocess.run(self.client(args), env=self.client_env(env),
                              cwd=cwd or self.jobs_dir, capture_output=capture, text=True,
                              timeout=timeout)

    def _check(self, args: Sequence[str], **kw) -> str:
        p = self.run(args, **kw)
        if p.returncode:
            raise SlurmClusterError(f"`{' '.join(args)}` failed ({p.returncode}): "
                                    f"{(p.stderr or p.stdout).strip()}")
        return p.stdout

    def sbatch(self, job: str | Sequence[str], *options: str, env: dict | None = None,
               chdir: str | Path | None = None) -> int:
        """Submit a batch job; return its id. ``job``: the script's text (a str, written to a
        file under the work directory) or sbatch's own arguments (``["--wrap", "srun
        hostname"]``). ``options`` go before it; ``chdir``: the job's working directory
        (default ``jobs_dir``); ``env``: the environment the job inherits (default: ours)."""
        if isinstance(job, str):
            script = self.workdir / "jobs" / f"job-{secrets.token_hex(4)}.sh"
            script.write_text(job)
            job = [str(script)]
        out = self._check(["sbatch", "--parsable", *options, *job], env=env, cwd=chdir)
        return int(out.strip().split(";")[0])

    def job(self, jobid: int) -> dict[str, str]:
        """``scontrol show job -o <id>`` as a dict (JobState, Reason, NodeList, ExitCode, ...)."""
        return parse_fields(self._check(["scontrol", "show", "job", "-o", str(jobid)]))

    def jobs(self) -> list[dict[str, str]]:
        """Every job slurmctld knows (finished ones stay for MinJobAge = 600 s)."""
        out = self._check(["scontrol", "show", "job", "-o"])
        return [parse_fields(line) for line in out.splitlines() if line.startswith("JobId=")]

    def wait(self, jobid: int, states: Sequence[str] = ENDED, timeout: float = 60.0) -> dict:
        """Poll ``scontrol show job`` every 0.3 s until the job's state is in ``states``;
        return its fields. Past ``timeout`` raise with the job's line and the daemons' logs."""
        deadline, info = time.monotonic() + timeout, {}
        while True:
            info = self.job(jobid)
            if info.get("JobState") in states:
                return info
            if time.monotonic() > deadline:
                line = " ".join(f"{k}={v}" for k, v in info.items())
                raise SlurmClusterError(f"job {jobid} not in {'/'.join(states)} after "
                                        f"{timeout:g} s: {line}\n{self.logs()}")
            time.sleep(POLL_S)

    def wait_running(self, jobid: int, timeout: float = 30.0) -> dict:
        info = self.wait(jobid, ("RUNNING", *ENDED), timeout)
        if info["JobState"] != "RUNNING":
            out = Path(info.get("StdOut", ""))
            tail = _tail(out) if out.is_file() else "(no output)"
            raise SlurmClusterError(f"job {jobid} ended ({info['JobState']}, exit "
                                    f"{info.get('ExitCode')}) before it was seen running; "
                                    f"its output:\n{tail}\n{self.logs()}")
        return info

    def output(self, jobid: int) -> str:
        """The job's stdout file (StdOut of ``scontrol show job``)."""
        return Path(self.job(jobid)["StdOut"]).read_text(errors="replace")

    def release(self, jobid: int) -> None:
        """Let a pending job start now. A requeued job waits for a BeginTime about 120 s
        ahead (Slurm's guard against a stale credential); ``StartTime=now`` clears it and
        the job starts at the next scheduling pass (~1 s). A held job is released too.
        The hold guards against the job's own revoked credential: slurmd refuses a launch
        whose credential was made in the same second as the requeue revoked the old one
        ("Killing non-startable batch job", the job FAILED). So this waits for the next
        second and for every node to finish completing (at most 30 s) first."""
        time.sleep(1.1)
        deadline = time.monotonic() + 30.0
        while (any(state.startswith("comp") for state in self.node_states().values())
               and time.monotonic() < deadline):
            time.sleep(POLL_S)
        self._check(["scontrol", "update", f"JobId={jobid}", "StartTime=now"])
        if "Held" in self.job(jobid).get("Reason", ""):  # JobHeldUser / JobHeldAdmin
            self._check(["scontrol", "release", str(jobid)])

    def signal(self, jobid: int, sig: str | int, batch: bool = False, full: bool = False) -> None:
        """``scancel --signal``: by default to every step but the batch script; ``batch``:
        the batch script only; ``full``: every step and the batch script."""
        if batch and full:
            raise ValueError("pick one of batch (the batch script only) and full (everything)")
        name = signal.Signals(sig).name.removeprefix("SIG") if isinstance(sig, int) else sig
        self._check(["scancel", f"--signal={name}", *(["--batch"] if batch else []),
                     *(["--full"] if full else []), str(jobid)])

    def cancel(self, jobid: int) -> None:
        self._check(["scancel", str(jobid)])

    def requeue(self, jobid: int) -> None:
        self._check(["scontrol", "requeue", str(jobid)])

    def drain(self, node: str, reason: str = "test") -> None:
        self._check(["scontrol", "update", f"NodeName={node}", "State=DRAIN", f"Reason={reason}"])

    def resume(self, node: str) -> None:
        self._check(["scontrol", "update", f"NodeName={node}", "State=RESUME"])

    def node_states(self) -> dict[str, str]:
        """{node: sinfo state} (idle, alloc, mix, drain, down*, ...)."""
        out = self.run(["sinfo", "-h", "-N", "-o", "%N %t"], timeout=10).stdout
        return dict(line.split()[:2] for line in out.splitlines() if len(line.split()) >= 2)

    def logs(self, lines: int = 15) -> str:
        """The tail of every daemon's log, for error messages."""
        if self.workdir is None:
            return ""
        logs = [*sorted((self.workdir / "log").glob("*.log")), self.workdir / "munge/munged.log"]
        return "\n".join(f"--- {p.name}\n{_tail(p, lines)}" for p in logs)

    def _say(self, msg: str) -> None:
        if self.log:
            self.log(f"slurmcluster: {msg}")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _stop(p: subprocess.Popen, grace: float = 3.0) -> None:
    """SIGTERM, wait up to ``grace`` s, then SIGKILL ``p``'s process group."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 2.0)):
        if p.poll() is not None:
            return
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            return
        try:
            p.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            pass
