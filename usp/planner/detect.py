"""Fill a ``ClusterSpec`` from what this machine and its launcher say.

Sources, each optional (missing ones fall back to the configured spec):

- launcher environment: nodes and ranks per node from torchrun (``GROUP_WORLD_SIZE``,
  ``WORLD_SIZE`` / ``LOCAL_WORLD_SIZE``) or Slurm (``SLURM_JOB_NUM_NODES``,
  ``SLURM_NTASKS_PER_NODE``, ``SLURM_GPUS_ON_NODE`` ...);
- ``nvidia-smi topo -m`` / ``nvidia-smi nvlink -s``: NVLink (links x speed) or PCIe, and
  ``--query-gpu``: device memory and the PCIe generation/width;
- ``/sys/class/infiniband/*/ports/*/{rate,state,link_layer}``: IB or RoCE line rate.

The sysfs root and the command runner are parameters, so tests use fakes. Nothing is
read at import time.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ..config.cluster import ClusterSpec

Runner = Callable[[Sequence[str]], "str | None"]  # stdout, or None when it cannot run

NVLINK_LINK_BW = 25.0e9  # bytes/s per NVLink (gens 2-4) per direction
PCIE_EFFICIENCY = 0.8  # achieved / raw PCIe payload rate for large P2P copies
PCIE_GT = {1: 2.5, 2: 5.0, 3: 8.0, 4: 16.0, 5: 32.0, 6: 64.0}  # GT/s per lane


def run_command(cmd: Sequence[str], timeout_s: float = 10.0) -> str | None:
    """Run ``cmd``; its stdout, or None when missing, failing or hanging."""
    if shutil.which(cmd[0]) is None:
        return None
    try:
        out = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout if out.returncode == 0 else None


@dataclass
class DetectReport:
    """Per ``ClusterSpec`` field: detected (value and source) or assumed (from the spec)."""

    spec_name: str
    detected: dict[str, str] = field(default_factory=dict)  # field -> "value (source)"
    assumed: dict[str, str] = field(default_factory=dict)  # field -> value taken from the spec
    warnings: list[str] = field(default_factory=list)

    def line(self) -> str:
        """One log line."""
        det = ", ".join(f"{k}={v}" for k, v in self.detected.items()) or "nothing"
        assumed = ", ".join(f"{k}={v}" for k, v in self.assumed.items()) or "nothing"
        out = f"topology: detected {det}; assumed from {self.spec_name}: {assumed}"
        return out + (f"; WARNING {'; '.join(self.warnings)}" if self.warnings else "")

    def __str__(self) -> str:
        return self.line()


# ---- launcher environment ---------------------------------------------------------------


def _int(env: Mapping[str, str], key: str) -> int | None:
    """``env[key]`` as a positive int; Slurm's '8(x4)' and 'h100:8' forms give 8."""
    raw = env.get(key, "").strip()
    m = re.fullmatch(r"(?:[\w-]+:)?(\d+)(?:\(x\d+\))?(?:,.*)?", raw)
    return int(m.group(1)) if m and int(m.group(1)) > 0 else None


def _first(env: Mapping[str, str], keys: Sequence[str]) -> tuple[int, str] | None:
    for k in keys:
        v = _int(env, k)
        if v is not None:
            return v, k
    return None


def launcher_layout(env: Mapping[str, str]) -> tuple[dict[str, tuple[int, str]], list[str]]:
    """{'nodes'|'ranks_per_node': (value, env source)} from torchrun, then Slurm; warnings."""
    found: dict[str, tuple[int, str]] = {}
    warns: list[str] = []
    world, local = _int(env, "WORLD_SIZE"), _int(env, "LOCAL_WORLD_SIZE")
    if local:  # torchrun: the ranks actually launched on this node
        found["ranks_per_node"] = (local, "LOCAL_WORLD_SIZE")
    else:
        tasks = _first(env, ["SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE"])
        gpus = _first(env, ["SLURM_GPUS_ON_NODE", "SLURM_GPUS_PER_NODE"])
        if tasks and tasks[0] > 1:
            found["ranks_per_node"] = tasks
        elif gpus:  # one launcher task per node that will start one rank per GPU
            found["ranks_per_node"] = gpus
        elif tasks:
            found["ranks_per_node"] = tasks
        else:
            nproc = _first(env, ["PET_NPROC_PER_NODE", "NPROC_PER_NODE"])
            if nproc:
                found["ranks_per_node"] = nproc
    nodes = _first(env, ["GROUP_WORLD_SIZE"])
    if nodes is None and world and local and world % local == 0:
        nodes = (world // local, "WORLD_SIZE/LOCAL_WORLD_SIZE")
    nodes = nodes or _first(env, ["SLURM_JOB_NUM_NODES", "SLURM_NNODES", "NNODES", "PET_NNODES"])
    if nodes:
        found["nodes"] = nodes
    if world and "nodes" in found and "ranks_per_node" in found:
        n, k = found["nodes"][0], found["ranks_per_node"][0]
        if n * k != world:
            warns.append(f"WORLD_SIZE {world} != nodes {n} x ranks per node {k}")
    return found, warns


# ---- nvidia-smi ---------------------------------------------------------------------------


def parse_topo(text: str) -> tuple[int, int | None]:
    """(GPU count, fewest NVLinks between any two GPUs, or None when some pair is PCIe)
    from ``nvidia-smi topo -m``."""
    rows = [ln.split() for ln in text.splitlines() if re.match(r"GPU\d+\s", ln)]
    n = len(rows)
    links: list[int] = []
    for i, cells in enumerate(rows):
        for j, cell in enumerate(cells[1 : n + 1]):
            if i == j:
                continue
            m = re.fullmatch(r"NV(\d+)", cell)
            if m is None:
                return n, None  # PIX/PXB/PHB/NODE/SYS: this pair talks over PCIe
            links.append(int(m.group(1)))
    return n, (min(links) if links else None)


def parse_nvlink_status(text: str) -> tuple[float, int] | None:
    """(bytes/s per direction of the slowest GPU, its active links) from
    ``nvidia-smi nvlink -s``; None when no link is up."""
    per_gpu: list[list[float]] = []
    for ln in text.splitlines():
        if re.match(r"\s*GPU \d+:", ln):
            per_gpu.append([])
        m = re.match(r"\s*Link \d+:\s*([\d.]+)\s*GB/s", ln)
        if m and per_gpu:
            per_gpu[-1].append(float(m.group(1)) * 1e9)
    active = [links for links in per_gpu if links]
    if not active or len(active) < len(per_gpu):
        return None
    slowest = min(active, key=sum)
    return sum(slowest), len(slowest)


def parse_gpu_query(text: str) -> tuple[float | None, float | None, str]:
    """(memory bytes, PCIe bytes/s per direction, description) from
    ``--query-gpu=memory.total,pcie.link.gen.max,pcie.link.width.max`` (csv, no units)."""
    first = next((ln for ln in text.splitlines() if ln.strip()), "")
    cells = [c.strip() for c in first.split(",")]
    num = [float(c) if re.fullmatch(r"[\d.]+", c) else None for c in cells + [""] * 3]
    mem = num[0] * 2**20 if num[0] else None  # MiB
    gen, width = num[1], num[2]
    if not gen or not width or int(gen) not in PCIE_GT:
        return mem, None, ""
    enc = 128 / 130 if gen >= 3 else 8 / 10
    bw = PCIE_GT[int(gen)] * 1e9 * enc / 8 * width * PCIE_EFFICIENCY
    return mem, bw, f"PCIe Gen{int(gen)} x{int(width)}"


# ---- InfiniBand / RoCE ---------------------------------------------------------------------


def read_ib_ports(sysfs_root: str | Path) -> list[tuple[str, float, str]]:
    """Active RDMA ports as (name, Gb/s, 'IB'|'RoCE') from ``<root>/class/infiniband``."""
    base = Path(sysfs_root) / "class" / "infiniband"
    ports = []
    for port in sorted(base.glob("*/ports/*")) if base.is_dir() else []:
        try:
            state = (port / "state").read_text()
            rate = (port / "rate").read_text()
        except OSError:
            continue
        m = re.match(r"\s*([\d.]+)\s*Gb/sec", rate)
        if "ACTIVE" not in state or m is None:
            continue
        layer_file = port / "link_layer"
        layer = layer_file.read_text().strip() if layer_file.is_file() else "InfiniBand"
        kind = "RoCE" if layer.lower() == "ethernet" else "IB"
        ports.append((f"{port.parts[-3]}/{port.name}", float(m.group(1)), kind))
    return ports


# ---- all together ---------------------------------------------------------------------------


def detect_topology(
    env: Mapping[str, str] = os.environ,
    spec: ClusterSpec | None = None,
    *,
    sysfs_root: str | Path = "/sys",
    run: Runner = run_command,
) -> tuple[ClusterSpec, DetectReport]:
    """``spec`` (default: ``ClusterSpec()``) with every field this machine reveals replaced.

    Returns the new spec and a report of which fields were detected (and from where) and
    which were assumed. Bandwidths are per GPU per direction, in bytes/s.
    """
    spec = spec or ClusterSpec()
    report = DetectReport(spec.name)
    vals: dict[str, float] = {}

    def found(key: str, value: float, shown: str, source: str) -> None:
        vals[key] = value
        report.detected[key] = f"{shown} ({source})"

    layout, report.warnings = launcher_layout(env)
    for key, (v, src) in layout.items():
        found(key, v, str(v), src)

    topo = run(["nvidia-smi", "topo", "-m"])
    n_gpus, nv = parse_topo(topo) if topo else (0, None)
    if n_gpus and "ranks_per_node" not in vals:
        found("ranks_per_node", n_gpus, str(n_gpus), "nvidia-smi topo -m")
    elif n_gpus and n_gpus < vals["ranks_per_node"]:
        report.warnings.append(f"{vals['ranks_per_node']} ranks per node but {n_gpus} GPUs")
    query = run(["nvidia-smi", "--query-gpu=memory.total,pcie.link.gen.max,"
                 "pcie.link.width.max", "--format=csv,noheader,nounits"])
    mem, pcie, pcie_desc = parse_gpu_query(query) if query else (None, None, "")
    if mem:
        found("mem_bytes", mem, f"{mem / 2**30:.0f} GiB", "nvidia-smi --query-gpu")
    if n_gpus > 1 and nv is not None:
        status = run(["nvidia-smi", "nvlink", "-s"])
        measured = parse_nvlink_status(status) if status else None
        if measured:
            found("intra_bw", measured[0], f"{measured[0] / 1e9:.0f} GB/s",
                  f"nvidia-smi nvlink -s: {measured[1]} links")
        else:
            bw = nv * NVLINK_LINK_BW
            found("intra_bw", bw, f"{bw / 1e9:.0f} GB/s", f"nvidia-smi topo -m: NV{nv}")
    elif n_gpus > 1:
        bw = pcie or 0.8 * 31.5e9  # unknown generation: assume Gen4 x16
        found("intra_bw", bw, f"{bw / 1e9:.0f} GB/s",
              f"nvidia-smi topo -m: PCIe{', ' + pcie_desc if pcie_desc else ', Gen4 x16 assumed'}")

    ports = read_ib_ports(sysfs_root)
    if ports:
        per_node = int(vals.get("ranks_per_node", spec.ranks_per_node))
        rates = sorted((r for _, r, _ in ports), reverse=True)[:per_node]
        bw = sum(rates) / len(rates) * 1e9 / 8  # one NIC's rate (mean of the fastest)
        share = -(-per_node // len(rates))  # GPUs per NIC: 1 on rail-optimised nodes
        kinds = "/".join(sorted({k for _, _, k in ports}))
        found("inter_bw", bw, f"{bw / 1e9:.1f} GB/s per NIC",
              f"sysfs: {len(ports)} active {kinds} ports, top {len(rates)} x "
              f"{rates[-1]:g}-{rates[0]:g} Gb/s over {per_node} GPUs")
        found("gpus_per_nic", share, str(share),
              "one NIC per GPU" if share == 1 else f"{len(rates)} NICs for {per_node} GPUs")

    for key, value in vals.items():
        old = getattr(spec, key)
        if key in ("intra_bw", "inter_bw", "mem_bytes") and abs(value - old) > 0.25 * old:
            report.warnings.append(
                f"spec {spec.name} says {key}={old:.3g}, using detected {value:.3g}"
            )
    report.assumed = {
        k: f"{getattr(spec, k):.3g}"
        for k in ("ranks_per_node", "nodes", "intra_bw", "intra_latency_s", "inter_bw",
                  "inter_latency_s", "peak_flops", "mem_bytes", "mfu", "hbm_bw")
        if k not in vals
    }
    ints = {k: int(v) for k, v in vals.items()
            if k in ("nodes", "ranks_per_node", "gpus_per_nic")}
    return spec.replace(**{**vals, **ints}), report
