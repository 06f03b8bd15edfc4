"""Topology detection with fake launcher environments, fake nvidia-smi and a fake sysfs."""

from __future__ import annotations

from pathlib import Path

import pytest

from usp.planner import ClusterSpec, detect_topology, load_cluster
from usp.planner.detect import (
    launcher_layout,
    parse_gpu_query,
    parse_nvlink_status,
    parse_topo,
    read_ib_ports,
)

TOPO_NV18 = """\
\tGPU0\tGPU1\tGPU2\tGPU3\tNIC0\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID
GPU0\t X \tNV18\tNV18\tNV18\tPXB\t0-55\t0\t\tN/A
GPU1\tNV18\t X \tNV18\tNV18\tSYS\t0-55\t0\t\tN/A
GPU2\tNV18\tNV18\t X \tNV18\tSYS\t56-111\t1\t\tN/A
GPU3\tNV18\tNV18\tNV18\t X \tSYS\t56-111\t1\t\tN/A

Legend:

  X    = Self
  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes
  NV#  = Connection traversing a bonded set of # NVLinks
"""

TOPO_PCIE = """\
\tGPU0\tGPU1\tGPU2\tCPU Affinity\tNUMA Affinity
GPU0\t X \tPIX\tSYS\t0-31\t0
GPU1\tPIX\t X \tSYS\t0-31\t0
GPU2\tSYS\tSYS\t X \t32-63\t1
"""


def nvlink_status(gpus: int, links: int, speed: float = 26.562) -> str:
    out = []
    for g in range(gpus):
        out.append(f"GPU {g}: NVIDIA H100 80GB HBM3 (UUID: GPU-{g:08d})")
        out += [f"\t Link {i}: {speed} GB/s" for i in range(links)]
    return "\n".join(out) + "\n"


class FakeSmi:
    """Answers nvidia-smi sub-commands from a dict; records what was asked."""

    def __init__(self, answers: dict[str, str | None]):
        self.answers, self.calls = answers, []

    def __call__(self, cmd):
        self.calls.append(" ".join(cmd[1:3]))
        key = "query" if cmd[1].startswith("--query-gpu") else " ".join(cmd[1:3])
        return self.answers.get(key)


def no_smi(cmd):
    return None


def make_sysfs(root: Path, ports: list[tuple[str, str, str, str]]) -> Path:
    """ports: (device, rate text, state text, link layer)."""
    for dev, rate, state, layer in ports:
        p = root / "class" / "infiniband" / dev / "ports" / "1"
        p.mkdir(parents=True)
        (p / "rate").write_text(rate + "\n")
        (p / "state").write_text(state + "\n")
        (p / "link_layer").write_text(layer + "\n")
    return root


NDR = ("400 Gb/sec (4X NDR)", "4: ACTIVE", "InfiniBand")


# ---- launcher environment -------------------------------------------------------------------


def test_torchrun_env():
    found, warns = launcher_layout({"WORLD_SIZE": "32", "LOCAL_WORLD_SIZE": "8",
                                    "GROUP_WORLD_SIZE": "4"})
    assert found == {"ranks_per_node": (8, "LOCAL_WORLD_SIZE"), "nodes": (4, "GROUP_WORLD_SIZE")}
    assert warns == []
    found, _ = launcher_layout({"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"})
    assert found["nodes"] == (2, "WORLD_SIZE/LOCAL_WORLD_SIZE")


def test_slurm_env_one_launcher_task_per_node_uses_gpus():
    env = {"SLURM_JOB_NUM_NODES": "4", "SLURM_NTASKS_PER_NODE": "1", "SLURM_GPUS_ON_NODE": "8"}
    found, _ = launcher_layout(env)
    assert found == {"ranks_per_node": (8, "SLURM_GPUS_ON_NODE"),
                     "nodes": (4, "SLURM_JOB_NUM_NODES")}


def test_slurm_env_task_per_gpu_and_compact_forms():
    found, _ = launcher_layout({"SLURM_NNODES": "2", "SLURM_TASKS_PER_NODE": "8(x2)"})
    assert found == {"ranks_per_node": (8, "SLURM_TASKS_PER_NODE"), "nodes": (2, "SLURM_NNODES")}
    found, _ = launcher_layout({"SLURM_NNODES": "2", "SLURM_GPUS_PER_NODE": "h100:4"})
    assert found["ranks_per_node"] == (4, "SLURM_GPUS_PER_NODE")


def test_torchrun_wins_over_slurm_and_mismatch_warns():
    env = {"LOCAL_WORLD_SIZE": "4", "WORLD_SIZE": "12", "GROUP_WORLD_SIZE": "2",
           "SLURM_NTASKS_PER_NODE": "8", "SLURM_NNODES": "2"}
    found, warns = launcher_layout(env)
    assert found["ranks_per_node"] == (4, "LOCAL_WORLD_SIZE")
    assert warns == ["WORLD_SIZE 12 != nodes 2 x ranks per node 4"]


# ---- parsers ----------------------------------------------------------------------------------


def test_parse_topo():
    assert parse_topo(TOPO_NV18) == (4, 18)
    assert parse_topo(TOPO_PCIE) == (3, None)
    mixed = TOPO_NV18.replace("GPU3\tNV18", "GPU3\tSYS")
    assert parse_topo(mixed) == (4, None)  # one PCIe pair: the all-to-all waits for it


def test_parse_nvlink_status():
    bw, links = parse_nvlink_status(nvlink_status(4, 18))
    assert links == 18 and bw == pytest.approx(18 * 26.562e9)
    fewer = nvlink_status(2, 18) + nvlink_status(1, 12).replace("GPU 0", "GPU 2")
    assert parse_nvlink_status(fewer)[1] == 12  # slowest GPU counts
    down = "GPU 0: X\n\t Link 0: <inactive>\nGPU 1: X\n\t Link 0: <inactive>\n"
    assert parse_nvlink_status(down) is None


def test_parse_gpu_query():
    mem, bw, desc = parse_gpu_query("46068, 4, 16\n46068, 4, 16\n")
    assert mem == 46068 * 2**20 and desc == "PCIe Gen4 x16"
    assert bw == pytest.approx(16e9 * 128 / 130 / 8 * 16 * 0.8)  # ~25.2 GB/s
    assert parse_gpu_query("81559, [N/A], [N/A]") == (81559 * 2**20, None, "")


def test_read_ib_ports(tmp_path):
    root = make_sysfs(tmp_path, [("mlx5_0", *NDR), ("mlx5_1", "400 Gb/sec (4X NDR)", "1: DOWN",
                                 "InfiniBand"), ("mlx5_2", "100 Gb/sec (4X EDR)", "4: ACTIVE",
                                                 "Ethernet")])
    assert read_ib_ports(root) == [("mlx5_0/1", 400.0, "IB"), ("mlx5_2/1", 100.0, "RoCE")]
    assert read_ib_ports(tmp_path / "nothing") == []


# ---- detect_topology ---------------------------------------------------------------------------


def test_h100_node_detected(tmp_path):
    root = make_sysfs(tmp_path, [(f"mlx5_{i}", *NDR) for i in range(8)]
                      + [("mlx5_bond", "25 Gb/sec (1X EDR)", "4: ACTIVE", "Ethernet")])
    smi = FakeSmi({"topo -m": TOPO_NV18, "nvlink -s": nvlink_status(4, 18, 25.0),
                   "query": "81559, 5, 16"})
    env = {"WORLD_SIZE": "32", "LOCAL_WORLD_SIZE": "8"}
    spec, report = detect_topology(env, load_cluster("h100_ib"), sysfs_root=root, run=smi)
    assert (spec.nodes, spec.ranks_per_node) == (4, 8)
    assert report.warnings == ["8 ranks per node but 4 GPUs"]  # the fake topo lists 4
    assert spec.intra_bw == pytest.approx(450e9)
    assert spec.inter_bw == pytest.approx(50e9)  # top 8 NICs = one 400G rail per GPU
    assert spec.gpus_per_nic == 1
    assert spec.mem_bytes == 81559 * 2**20 and spec.peak_flops == 989e12
    assert set(report.detected) == {"ranks_per_node", "nodes", "intra_bw", "inter_bw",
                                    "gpus_per_nic", "mem_bytes"}
    assert set(report.assumed) == {"intra_latency_s", "inter_latency_s", "peak_flops",
                                   "mfu", "hbm_bw"}
    line = report.line()
    assert "intra_bw=450 GB/s (nvidia-smi nvlink -s: 18 links)" in line
    assert "inter_bw=50.0 GB/s per NIC (sysfs: 9 active IB/RoCE ports, top 8 x 400-400 Gb/s" \
        in line
    assert "assumed from h100_ib: intra_latency_s=5e-06" in line and "\n" not in line


def test_nvlink_from_topo_when_status_missing(tmp_path):
    smi = FakeSmi({"topo -m": TOPO_NV18})
    spec, report = detect_topology({}, ClusterSpec(), sysfs_root=tmp_path, run=smi)
    assert spec.ranks_per_node == 4 and spec.intra_bw == 18 * 25e9
    assert report.detected["ranks_per_node"] == "4 (nvidia-smi topo -m)"
    assert report.detected["intra_bw"] == "450 GB/s (nvidia-smi topo -m: NV18)"
    assert "nvlink -s" in smi.calls


def test_pcie_node_with_roce(tmp_path):
    root = make_sysfs(tmp_path, [(f"mlx5_{i}", "100 Gb/sec (4X EDR)", "4: ACTIVE", "Ethernet")
                                 for i in range(2)])
    smi = FakeSmi({"topo -m": TOPO_PCIE, "query": "46068, 4, 16"})
    env = {"SLURM_NNODES": "2", "SLURM_NTASKS_PER_NODE": "8"}
    spec, report = detect_topology(env, load_cluster("h100_ib"), sysfs_root=root, run=smi)
    assert spec.intra_bw == pytest.approx(25.2e9, rel=0.01)
    assert spec.inter_bw == pytest.approx(12.5e9)  # per NIC; 2 NICs shared by 8 GPUs
    assert spec.gpus_per_nic == 4 and isinstance(spec.gpus_per_nic, int)
    assert report.detected["gpus_per_nic"] == "4 (2 NICs for 8 GPUs)"
    assert "nvlink -s" not in smi.calls  # PCIe: no NVLink to ask about
    assert "PCIe, PCIe Gen4 x16" in report.detected["intra_bw"]
    assert "RoCE" in report.detected["inter_bw"]
    assert any(w.startswith("spec h100_ib says intra_bw=4.5e+11") for w in report.warnings)
    assert "WARNING" in report.line()


def test_nothing_detected_keeps_the_spec(tmp_path):
    base = load_cluster("a100_ib")
    spec, report = detect_topology({}, base, sysfs_root=tmp_path / "nope", run=no_smi)
    assert spec == base
    assert report.detected == {} and report.warnings == []
    assert len(report.assumed) == 10
    assert report.line().startswith("topology: detected nothing; assumed from a100_ib: "
                                    "ranks_per_node=8, nodes=4, intra_bw=3e+11")


def test_default_spec_when_none_given(tmp_path):
    spec, report = detect_topology({"LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "2"}, None,
                                   sysfs_root=tmp_path, run=no_smi)
    assert (spec.name, spec.ranks_per_node, spec.nodes) == ("unknown", 2, 1)
    assert spec.inter_bw == ClusterSpec().inter_bw and "inter_bw" in report.assumed
