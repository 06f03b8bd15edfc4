"""A simulated multi-node cluster on one Linux host: network namespaces joined by shaped links.

Each node is its own network namespace (and UTS namespace, so it has its own host name:
usp's all-gather of host names sees distinct hosts, as on a real cluster). Inside a node,
ranks talk over loopback (fast, like NVLink). Between nodes, traffic leaves through the
node's ``eth0`` veth, crosses a Linux bridge that lives in a dedicated "switch" namespace,
and is shaped with ``tc tbf`` to ``rate`` on both the node's egress and the switch port
towards the node (the NIC rate, like InfiniBand)::

    node0 ns [lo, eth0 10.77.0.1, tbf] --veth-- switch ns [br0, tbf per port] --veth-- node1 ...

Nothing is created in the root namespace except, for a moment, the veth pairs before they
are moved; all traffic stays inside the namespaces. ``close`` (run on leaving the ``with``
block, on errors and on ``KeyboardInterrupt``) removes everything.

``run`` starts ``torchrun --nnodes=N --nproc-per-node=K --node-rank=i --master-addr=<node0>``
on every node with ``GLOO_SOCKET_IFNAME=eth0``; torchrun gives ranks node-major
(rank // K = node)::

    with SimCluster(nodes=2, nproc_per_node=2, rate="1gbit") as cluster:
        result = cluster.run(["-m", "usp.cli", "trainer.steps=3"])
        assert result.returncode == 0, result.output
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
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

REQUIRED_TOOLS = ("ip", "tc", "unshare")
SUBNET = "10.77.0"  # private /24, only inside the namespaces this module creates
ROOT = Path(__file__).resolve().parents[2]  # the repository root
MASTER_PORT = 29500  # every node has its own network namespace: no clash with the host


def say(msg: str) -> None:
    """Print one line at once (output of several processes interleaves line by line)."""
    print(msg, flush=True)


class SimClusterError(RuntimeError):
    """The host cannot run a simulated cluster (not root, tools missing), or set-up failed."""


def remove_etc_dirs(dirs: list[Path]) -> None:
    """Remove the ``/etc/netns/<ns>`` folders made for our namespaces (and empty ``dirs``),
    then ``/etc/netns`` itself when nothing else is left in it."""
    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)
    dirs.clear()
    try:
        Path("/etc/netns").rmdir()  # only when empty: other users' entries stay
    except OSError:
        pass


def preflight(euid: int | None = None, which: Callable[[str], str | None] = shutil.which) -> None:
    """Raise ``SimClusterError`` naming what is missing: root, or ``ip``/``tc``/``unshare``.

    ``euid`` (default: this process's) and ``which`` (default ``shutil.which``) are the
    probes, injectable for tests."""
    if (os.geteuid() if euid is None else euid) != 0:
        raise SimClusterError(
            "simcluster needs root (it creates network namespaces, veth links, a bridge and "
            "tc qdiscs); run it as root, e.g. `sudo -E python -m tools.simcluster ...`"
        )
    missing = [t for t in REQUIRED_TOOLS if which(t) is None]
    if missing:
        raise SimClusterError(
            f"simcluster needs {', '.join(REQUIRED_TOOLS)} on PATH; missing: "
            f"{', '.join(missing)} (Debian/Ubuntu: apt-get install iproute2 util-linux)"
        )


def rate_to_bytes_per_s(rate: str) -> float:
    """tc rate text -> bytes/s: '1gbit' -> 1.25e8, '800mbit' -> 1e8, '50mbps' -> 5e7."""
    m = re.fullmatch(r"([0-9.]+)\s*([kmgt]?)(bit|bps)?", rate.strip().lower())
    if not m:
        raise ValueError(f"bad rate {rate!r}: write e.g. 1gbit, 800mbit or 100mbps")
    scale = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}[m.group(2)]
    value = float(m.group(1)) * scale
    return value / 8 if (m.group(3) or "bit") == "bit" else value


def p2p_rate(nbytes: int, src: int, dst: int, rounds: int = 3) -> float:
    """Bytes/s of one gloo send ``src`` -> ``dst`` of ``nbytes``, best of ``rounds``.

    Collective over the default group: every rank calls it (the others only take part in
    the barriers that bracket each transfer). A first, untimed round sets the connection up."""
    import torch
    import torch.distributed as dist

    rank, t, best = dist.get_rank(), torch.ones(nbytes // 4), float("inf")
    for i in range(rounds + 1):
        dist.barrier()
        t0 = time.perf_counter()
        if rank == src:
            dist.send(t, dst)
        elif rank == dst:
            dist.recv(t, src)
        dist.barrier()
        if i:
            best = min(best, time.perf_counter() - t0)
    return nbytes / best


def gloo_main(measure: Callable[[], dict], result: str | Path, timeout_s: float) -> int:
    """One rank of a lab worker that torchrun started on a simulated node: one intra-op
    thread (the ranks share the host's cores), a gloo group with ``timeout_s``,
    ``measure()`` on every rank, its result written as JSON to ``result`` by rank 0; the
    ranks leave together. Returns the exit code."""
    import json
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))
    try:
        res = measure()
        if dist.get_rank() == 0:
            Path(result).write_text(json.dumps(res, indent=2))
        dist.barrier()  # leave together: a rank tearing gloo down early can abort its peers
    finally:
        dist.destroy_process_group()
    return 0


def _loopback_probe(nbytes: int, rounds: int, result: str) -> None:
    rate = p2p_rate(nbytes, 0, 1, rounds)
    import torch.distributed as dist

    if dist.get_rank() == 0:
        Path(result).write_text(repr(rate))


def measure_loopback_bw(nbytes: int = 64 * 2**20, rounds: int = 3) -> float:
    """Bytes/s of one gloo send/recv between two local processes over loopback."""
    from usp.launch import spawn_local

    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "rate")
        spawn_local(_loopback_probe, 2, nbytes, rounds, result, threads=1, timeout_s=120)
        return float(Path(result).read_text())


def _sh(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """Run one ip/tc command; a failure raises with the command and its stderr."""
    p = subprocess.run(args, capture_output=True, text=True)
    if check and p.returncode:
        raise SimClusterError(f"`{' '.join(args)}` failed: {p.stderr.strip()}")
    return p


def _tbf(ns: str, dev: str, rate: str, burst: str, queue_ms: float) -> None:
    _sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate,
        "burst", burst, "latency", f"{queue_ms:g}ms")


@dataclass
class RunResult:
    """Outcome of ``SimCluster.run``: worst exit code and each node's output lines."""

    returncode: int
    node_returncodes: list[int]
    node_output: list[list[str]] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def output(self) -> str:
        return "\n".join(f"[node{i}] {line}" for i, lines in enumerate(self.node_output)
                         for line in lines)


class SimCluster:
    """Context manager: N network namespaces joined by a shaped bridge; ``run`` launches torchrun.

    ``rate``: tc rate of every node's link (e.g. ``"1gbit"``) or ``"auto"`` (loopback gloo
    throughput / ``ratio``). ``intra_rate``: also shape loopback inside each node (None:
    full speed). ``burst``: tbf bucket (default: 1/250 s of traffic, >= 256 KiB). ``mtu``:
    of the veth links (default 9000, jumbo frames as on InfiniBand/RoCE fabrics).
    ``queue_ms``: how long a packet may wait in a shaped link's queue (tbf ``latency``).
    With 100 ms, exchanges of over ~1 MB in both directions at once run at about half the
    rate (each direction's ACKs wait behind the other's queued data), so one large
    message is slower than several small ones; 30 ms removes that (a 1.5 MB exchange at
    300 mbit: 78 ms at 100 ms, 44 ms at 30 ms, 40 ms ideal). ``log``:
    where set-up messages and (``run(echo=True)``) node output lines go; None: nowhere.
    """

    def __init__(self, nodes: int = 2, nproc_per_node: int = 2, rate: str = "auto",
                 burst: str | None = None, ratio: float = 9.0, mtu: int = 9000,
                 intra_rate: str | None = None, log: Callable[[str], None] | None = say,
                 queue_ms: float = 100.0):
        if nodes < 1 or nproc_per_node < 1:
            raise ValueError(f"need nodes >= 1 and nproc_per_node >= 1, got {nodes} and "
                             f"{nproc_per_node}")
        if nodes > 200:
            raise ValueError(f"at most 200 nodes fit the /24 subnet, got {nodes}")
        if not queue_ms > 0:
            raise ValueError(f"queue_ms must be > 0, got {queue_ms}; e.g. 30")
        if ratio <= 0:
            raise ValueError(f"ratio must be > 0 (loopback / inter-node), got {ratio}; e.g. 9")
        for r in (rate, intra_rate):
            if r not in ("auto", None):
                rate_to_bytes_per_s(r)  # a bad rate raises here, before any namespace exists
        if intra_rate == "auto":
            raise ValueError("intra_rate takes a tc rate (e.g. 9gbit) or None, not 'auto'")
        self.nodes, self.nproc_per_node = nodes, nproc_per_node
        self.rate, self.burst, self.ratio, self.mtu = rate, burst, ratio, mtu
        self.intra_rate, self.log, self.queue_ms = intra_rate, log, queue_ms
        self.tag = secrets.token_hex(3)  # per-run suffix: concurrent clusters never clash
        self.namespaces: list[str] = []  # every namespace created, for clean-up
        self.loopback_bw: float | None = None
        self._procs: list[subprocess.Popen] = []
        self._etc_dirs: list[Path] = []
        self._lock = threading.Lock()

    # ---- names --------------------------------------------------------------------------
    def node_ns(self, i: int) -> str:
        return f"usp-{self.tag}-n{i}"

    @property
    def switch_ns(self) -> str:
        return f"usp-{self.tag}-sw"

    def node_ip(self, i: int) -> str:
        return f"{SUBNET}.{i + 1}"

    def hostname(self, i: int) -> str:
        return f"sim{self.tag}-node{i}"

    # ---- set-up / tear-down -------------------------------------------------------------
    def __enter__(self) -> SimCluster:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> None:
        preflight()
        if self.rate == "auto":
            self.loopback_bw = measure_loopback_bw()
            self.rate = f"{int(self.loopback_bw * 8 / self.ratio / 1e6)}mbit"
            self._say(f"loopback gloo {self.loopback_bw / 1e9:.2f} GB/s -> inter-node rate "
                      f"{self.rate} (1/{self.ratio:g})")
        burst = self.burst or f"{max(256 * 1024, int(rate_to_bytes_per_s(self.rate) / 250))}b"
        sw = self.switch_ns
        self._add_ns(sw)
        _sh("ip", "-n", sw, "link", "add", "br0", "type", "bridge")
        _sh("ip", "-n", sw, "link", "set", "br0", "up")
        for i in range(self.nodes):
            ns, host_end, node_end = self.node_ns(i), f"u{self.tag}h{i}", f"u{self.tag}n{i}"
            self._add_ns(ns)
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
            if self.intra_rate:  # slow the "NVLink" too, keeping the fast/slow ratio
                lo_burst = max(1 << 20, int(rate_to_bytes_per_s(self.intra_rate) / 250))
                _tbf(ns, "lo", self.intra_rate, f"{lo_burst}b", self.queue_ms)
            _sh("ip", "link", "add", host_end, "mtu", str(self.mtu), "type", "veth",
                "peer", "name", node_end, "mtu", str(self.mtu))
            # both ends leave the root namespace at once
            _sh("ip", "link", "set", host_end, "netns", sw)
            _sh("ip", "link", "set", node_end, "netns", ns)
            _sh("ip", "-n", ns, "link", "set", node_end, "name", "eth0")
            _sh("ip", "-n", ns, "addr", "add", f"{self.node_ip(i)}/24", "dev", "eth0")
            _sh("ip", "-n", ns, "link", "set", "eth0", "up")
            _sh("ip", "-n", sw, "link", "set", host_end, "master", "br0")
            _sh("ip", "-n", sw, "link", "set", host_end, "up")
            # the NIC rate: shaped leaving the node and leaving the switch towards the node
            _tbf(ns, "eth0", self.rate, burst, self.queue_ms)
            _tbf(sw, host_end, self.rate, burst, self.queue_ms)
        self._write_hosts()
        self._say(f"{self.nodes} nodes x {self.nproc_per_node} ranks, namespaces "
                  f"{self.node_ns(0)}..{self.node_ns(self.nodes - 1)}, inter-node {self.rate} "
                  f"(burst {burst}, mtu {self.mtu}, queue {self.queue_ms:g} ms)"
                  + (f", intra-node {self.intra_rate}" if self.intra_rate else ""))

    def _write_hosts(self) -> None:
        """/etc/netns/<ns>/hosts: `ip netns exec` mounts it over /etc/hosts in that node,
        so every node's host name resolves to its eth0 address, as on a real cluster."""
        lines = ["127.0.0.1 localhost"] + [f"{self.node_ip(i)} {self.hostname(i)}"
                                           for i in range(self.nodes)]
        for i in range(self.nodes):
            d = Path("/etc/netns", self.node_ns(i))
            d.mkdir(parents=True, exist_ok=True)
            self._etc_dirs.append(d)
            (d / "hosts").write_text("\n".join(lines) + "\n")

    def _add_ns(self, name: str) -> None:
        _sh("ip", "netns", "add", name)
        self.namespaces.append(name)

    def close(self) -> None:
        """Kill every child process group, then delete the namespaces (links and bridge go too)."""
        self._kill_all()
        for ns in reversed(self.namespaces):
            pids = _sh("ip", "netns", "pids", ns, check=False).stdout.split()
            for pid in pids:  # anything still holding the namespace (a stray grandchild)
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            _sh("ip", "netns", "del", ns, check=False)
        self.namespaces.clear()
        remove_etc_dirs(self._etc_dirs)

    def _kill_all(self) -> None:
        with self._lock:
            procs = [p for p in self._procs if p.poll() is None]
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for p in procs:
                try:
                    os.killpg(p.pid, sig)  # the node's whole process group (torchrun + ranks)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + 5.0
            for p in procs:
                try:
                    p.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
            procs = [p for p in procs if p.poll() is None]
            if not procs:
                break

    # ---- running ------------------------------------------------------------------------
    def node_command(self, i: int, cmd: list[str], master_port: int = MASTER_PORT) -> list[str]:
        """The argv that runs ``cmd`` (``-m module args`` or ``script.py args``) on node i."""
        if cmd and Path(cmd[0]).name.startswith("python") and len(cmd) > 1:
            cmd = cmd[1:]  # `python -m x` / `python script.py`: torchrun brings its own python
        torchrun = [sys.executable, "-m", "torch.distributed.run",
                    f"--nnodes={self.nodes}", f"--nproc-per-node={self.nproc_per_node}",
                    f"--node-rank={i}", f"--master-addr={self.node_ip(0)}",
                    f"--master-port={master_port}", *cmd]
        # own UTS namespace: the node's own host name, seen by socket.gethostname()
        inner = 'hostname "$0" && exec "$@"'
        return ["ip", "netns", "exec", self.node_ns(i), "unshare", "--uts", "--",
                "sh", "-c", inner, self.hostname(i), *torchrun]

    def run(self, cmd: list[str], env: dict | None = None, timeout: float | None = None,
            echo: bool = True) -> RunResult:
        """Run ``cmd`` on every node under torchrun; wait for all; worst exit code wins.

        A node that fails stops the others (their process groups get SIGTERM) so a run
        never hangs on a dead peer. ``timeout`` (s) kills every node and returns 124.
        ``echo``: pass each output line, prefixed ``[nodeI]``, to ``log`` as it comes.
        """
        if not self.namespaces:
            raise SimClusterError("SimCluster.run needs the cluster started (use `with`)")
        base = dict(os.environ if env is None else env)
        base.update(GLOO_SOCKET_IFNAME="eth0", PYTHONUNBUFFERED="1")
        base.setdefault("OMP_NUM_THREADS", "1")
        outputs: list[list[str]] = [[] for _ in range(self.nodes)]
        procs, readers = [], []
        t0 = time.monotonic()
        for i in range(self.nodes):
            # from the repository root, where ``-m tools.lab...`` (not installed) is found
            p = subprocess.Popen(self.node_command(i, cmd), env=base, cwd=ROOT,
                                 stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True, errors="replace",
                                 start_new_session=True)  # own process group: killable as one
            with self._lock:
                self._procs.append(p)
            procs.append(p)
            th = threading.Thread(target=self._pump, args=(i, p, outputs[i], echo), daemon=True)
            th.start()
            readers.append(th)
        timed_out = False
        try:
            while any(p.poll() is None for p in procs):
                if any(p.poll() not in (None, 0) for p in procs):
                    time.sleep(5.0)  # let the others report their own error, then stop them
                    self._kill_all()
                    break
                if timeout is not None and time.monotonic() - t0 > timeout:
                    timed_out = True
                    self._kill_all()
                    break
                time.sleep(0.1)
        finally:
            if any(p.poll() is None for p in procs):
                self._kill_all()
            for th in readers:
                th.join(timeout=5.0)
        codes = [124 if timed_out and p.returncode in (None, -9, -15) else p.returncode
                 for p in procs]
        codes = [c if c is not None else 1 for c in codes]
        worst = max(codes, key=lambda c: (c != 0, abs(c)))
        return RunResult(128 - worst if worst < 0 else worst, codes, outputs,
                         time.monotonic() - t0)

    def _pump(self, i: int, p: subprocess.Popen, sink: list[str], echo: bool) -> None:
        for line in p.stdout:
            line = line.rstrip("\n")
            sink.append(line)
            if echo and self.log:
                self.log(f"[node{i}] {line}")

    def _say(self, msg: str) -> None:
        if self.log:
            self.log(f"simcluster: {msg}")


def interrupt_on_signal(signum, frame):
    """A signal handler that raises ``KeyboardInterrupt``: unwinds through ``close``."""
    raise KeyboardInterrupt(f"signal {signum}")
