"""A small simulated multi-node cluster on one Linux host, for multi-node runs without nodes.

Each "node" is its own network namespace (and UTS namespace, so it has its own host name:
usp's all-gather of host names sees distinct hosts, exactly as on a real cluster). Inside
a node, ranks talk over loopback (fast, like NVLink). Between nodes, traffic leaves
through the node's ``eth0`` veth, crosses a Linux bridge that lives in a dedicated
"switch" namespace, and is shaped with ``tc tbf`` to ``--rate`` on both the node's egress
and the switch port towards the node (the NIC rate, like InfiniBand)::

    node0 ns [lo, eth0 10.77.0.1, tbf] --veth-- switch ns [br0, tbf per port] --veth-- node1 ...

Nothing is created in the root namespace except, for a moment, the veth pairs before they
are moved; all traffic stays inside the namespaces. Everything is removed on exit,
including on errors, Ctrl-C and SIGTERM.

Then every node runs ``torchrun --nnodes=N --nproc-per-node=K --node-rank=i
--master-addr=<node0> ...`` with ``GLOO_SOCKET_IFNAME=eth0``; torchrun gives ranks
node-major (rank // K = node). Output lines are prefixed with ``[nodeI]``; the exit code is
the worst of the nodes'.

    sudo python tools/simcluster.py --nodes 2 --nproc-per-node 2 --rate 1gbit -- \\
        -m usp.cli trainer.steps=3 logging=none parallel.ranks_per_node=null
    sudo python tools/simcluster.py --rate auto -- tools/bench_attention.py --quick

``--rate auto`` measures gloo throughput over loopback first and shapes the inter-node
links to 1/``--ratio`` of it (default 9: the NVLink/InfiniBand ratio of an H100 node,
450 GB/s vs 50 GB/s per GPU). Python API::

    with SimCluster(nodes=2, nproc_per_node=2, rate="1gbit") as cluster:
        result = cluster.run(["-m", "usp.cli", "trainer.steps=3"])
        assert result.returncode == 0, result.output
"""

from __future__ import annotations

import argparse
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

REQUIRED_TOOLS = ("ip", "tc", "unshare")
SUBNET = "10.77.0"  # private /24, only inside the namespaces this tool creates
MASTER_PORT = 29500  # every node has its own network namespace: no clash with the host
FAKE_NONROOT_ENV = "USP_SIMCLUSTER_FAKE_NONROOT"  # tests: exercise the refusal path


class SimClusterError(RuntimeError):
    """The host cannot run a simulated cluster (not root, tools missing), or set-up failed."""


def preflight() -> None:
    """Raise ``SimClusterError`` naming what is missing: root, or ``ip``/``tc``/``unshare``."""
    if os.geteuid() != 0 or os.environ.get(FAKE_NONROOT_ENV):
        raise SimClusterError(
            "simcluster needs root (it creates network namespaces, veth links, a bridge and "
            "tc qdiscs); run it as root, e.g. `sudo -E python tools/simcluster.py ...`"
        )
    missing = [t for t in REQUIRED_TOOLS if shutil.which(t) is None]
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


def _loopback_probe(rank: int, nbytes: int, rounds: int, port: int) -> None:
    """One side of ``measure_loopback_bw`` (a child process): best time of a send/recv."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    t, best = torch.empty(nbytes // 4), float("inf")
    for _ in range(rounds + 1):  # the first round sets the connection up
        dist.barrier()
        t0 = time.perf_counter()
        dist.send(t, 1) if rank == 0 else dist.recv(t, 0)
        dist.barrier()
        best = min(best, time.perf_counter() - t0)
    if rank == 0:
        print(nbytes / best, flush=True)
    dist.destroy_process_group()


def measure_loopback_bw(nbytes: int = 64 * 2**20, rounds: int = 3) -> float:
    """Bytes/s of one gloo send/recv between two local processes over loopback."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    procs = [subprocess.Popen([sys.executable, __file__, "--loopback-probe", str(r), str(nbytes),
                               str(rounds), port], stdout=subprocess.PIPE, text=True)
             for r in range(2)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise SimClusterError("measuring loopback gloo throughput failed")
    return float(outs[0].strip().splitlines()[-1])


def _sh(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """Run one ip/tc command; a failure raises with the command and its stderr."""
    p = subprocess.run(args, capture_output=True, text=True)
    if check and p.returncode:
        raise SimClusterError(f"`{' '.join(args)}` failed: {p.stderr.strip()}")
    return p


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
    throughput / ``ratio``). ``burst``: tbf bucket (default: 1/250 s of traffic, >= 256 KiB).
    ``mtu``: of the veth links (default 9000, jumbo frames as on InfiniBand/RoCE fabrics).
    """

    def __init__(self, nodes: int = 2, nproc_per_node: int = 2, rate: str = "auto",
                 burst: str | None = None, ratio: float = 9.0, mtu: int = 9000,
                 quiet: bool = False, intra_rate: str | None = None):
        if nodes < 1 or nproc_per_node < 1:
            raise ValueError(
                f"need nodes >= 1 and nproc_per_node >= 1, got {nodes}, {nproc_per_node}")
        if nodes > 200:
            raise ValueError(f"at most 200 nodes fit the /24 subnet, got {nodes}")
        self.nodes, self.nproc_per_node = nodes, nproc_per_node
        self.rate, self.burst, self.ratio, self.mtu, self.quiet = rate, burst, ratio, mtu, quiet
        self.intra_rate = intra_rate  # None: loopback at full speed
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

    @property
    def rate_bytes_per_s(self) -> float:
        return rate_to_bytes_per_s(self.rate)

    # ---- set-up / tear-down -------------------------------------------------------------
    def __enter__(self) -> "SimCluster":
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
        rate_bps = self.rate_bytes_per_s
        burst = self.burst or f"{max(256 * 1024, int(rate_bps / 250))}b"
        sw = self.switch_ns
        self._add_ns(sw)
        _sh("ip", "-n", sw, "link", "add", "br0", "type", "bridge")
        _sh("ip", "-n", sw, "link", "set", "br0", "up")
        for i in range(self.nodes):
            ns, host_end, node_end = self.node_ns(i), f"u{self.tag}h{i}", f"u{self.tag}n{i}"
            self._add_ns(ns)
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
            if self.intra_rate:  # slow the "NVLink" too, keeping the fast/slow ratio
                lo_burst = f"{max(1 << 20, int(rate_to_bytes_per_s(self.intra_rate) / 250))}b"
                _sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "lo", "root",
                    "tbf", "rate", self.intra_rate, "burst", lo_burst, "latency", "100ms")
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
            for where, dev in ((ns, "eth0"), (sw, host_end)):
                _sh("ip", "netns", "exec", where, "tc", "qdisc", "add", "dev", dev, "root",
                    "tbf", "rate", self.rate, "burst", burst, "latency", "100ms")
        self._write_hosts()
        self._say(f"{self.nodes} nodes x {self.nproc_per_node} ranks, namespaces "
                  f"{self.node_ns(0)}..{self.node_ns(self.nodes - 1)}, inter-node {self.rate} "
                  f"(burst {burst}, mtu {self.mtu})"
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
        for d in self._etc_dirs:
            shutil.rmtree(d, ignore_errors=True)
        self._etc_dirs.clear()
        try:
            Path("/etc/netns").rmdir()  # only when empty: other users' entries stay
        except OSError:
            pass

    def _kill_all(self) -> None:
        with self._lock:
            procs = [p for p in self._procs if p.poll() is None]
        for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
            for p in procs:
                try:
                    os.killpg(p.pid, sig)  # the node's whole process group (torchrun + ranks)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + wait
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
            p = subprocess.Popen(self.node_command(i, cmd), env=base, stdout=subprocess.PIPE,
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
            if echo:
                print(f"[node{i}] {line}", flush=True)

    def _say(self, msg: str) -> None:
        if not self.quiet:
            print(f"simcluster: {msg}", flush=True)


def interrupt_on_signal(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")  # unwinds through the finally: clean-up


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description="Run a torchrun command on a simulated multi-node cluster "
                    "(network namespaces + shaped veth links). Needs root.",
        usage="%(prog)s [options] -- (-m module | script.py) [args...]")
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--nproc-per-node", type=int, default=2)
    p.add_argument("--rate", default="auto",
                   help="inter-node link rate in tc units (1gbit, 800mbit) or 'auto': "
                        "loopback gloo throughput / --ratio (default)")
    p.add_argument("--ratio", type=float, default=9.0,
                   help="fast/slow ratio for --rate auto (NVLink/IB ~ 9)")
    p.add_argument("--burst", default=None, help="tbf burst (default: rate/250, >= 256 KiB)")
    p.add_argument("--mtu", type=int, default=9000)
    p.add_argument("--intra-rate", default=None,
                   help="also shape loopback inside each node (e.g. 9gbit with --rate 1gbit): "
                        "slower links at the same ratio, to match a GPU's compute/comm balance")
    p.add_argument("--timeout", type=float, default=None, help="kill everything after N s")
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--loopback-probe"]:  # internal: a child of measure_loopback_bw
        _loopback_probe(*(int(x) for x in argv[1:5]))
        return 0
    if "--" not in argv:
        p.error("put the command after `--`, e.g. -- -m usp.cli trainer.steps=3")
    split = argv.index("--")
    args, cmd = p.parse_args(argv[:split]), argv[split + 1:]
    if not cmd:
        p.error("no command after `--`")
    try:
        preflight()
    except SimClusterError as e:
        print(f"simcluster: error: {e}", file=sys.stderr)
        return 2
    old = {s: signal.signal(s, interrupt_on_signal) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        with SimCluster(args.nodes, args.nproc_per_node, args.rate, args.burst, args.ratio,
                        args.mtu, intra_rate=args.intra_rate) as cluster:
            result = cluster.run(cmd, timeout=args.timeout)
        print(f"simcluster: node exit codes {result.node_returncodes}, "
              f"{result.seconds:.1f} s", flush=True)
        return result.returncode
    except SimClusterError as e:
        print(f"simcluster: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("simcluster: interrupted; cleaned up", file=sys.stderr)
        return 130
    finally:
        for s, h in old.items():
            signal.signal(s, h)


if __name__ == "__main__":
    sys.exit(main())
