"""The hardware a run is planned for: one ``ClusterSpec`` (``configs/cluster/``).

Units everywhere: bytes, seconds, bytes/s, FLOP/s. Bandwidths are *unidirectional, per
link*: ``intra_bw`` is what one GPU can push to its node peers (NVLink or PCIe),
``inter_bw`` what one NIC can push off the node. On a rail-optimised node every GPU has
its own NIC (``gpus_per_nic: 1``) and both are per-GPU figures. When ``gpus_per_nic``
(or ``gpus_per_intra_link``) GPUs share one link, the GPUs of a node that send over it
at the same moment split it; one sending alone gets all of it.

The YAML files in ``configs/cluster/`` use exactly the field names below, so a Hydra
structured-config schema built from this dataclass validates them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import yaml

from .files import CONFIG_DIR

GiB = 1024**3


@dataclass
class ClusterSpec:
    """A homogeneous cluster of ``nodes`` x ``ranks_per_node`` accelerators.

    Defaults describe an unknown PCIe box on a 100G network; they are what detection falls
    back to when no spec is given, and every such value is reported as assumed.
    """

    name: str = "unknown"
    ranks_per_node: int = 1
    nodes: int = 1
    intra_bw: float = 25.0e9  # bytes/s per GPU per direction inside a node
    intra_latency_s: float = 10.0e-6  # one intra-node collective/P2P start-up
    inter_bw: float = 12.5e9  # bytes/s per GPU rail per direction between nodes
    inter_latency_s: float = 10.0e-6  # one inter-node message start-up
    peak_flops: float = 100.0e12  # dense bf16 FLOP/s per GPU
    mem_bytes: float = 16.0 * GiB  # device memory per GPU
    mfu: float = 0.4  # achievable fraction of peak_flops for attention and matmuls
    hbm_bw: float = 1.0e12  # device memory bytes/s (memory-bound work: ring out/LSE merges)
    overlap: float = 1.0  # share of a ring transfer that can hide behind block compute
    # share of a pipelined all-to-all stage's transfer that the neighbouring stage's compute
    # hides (usp_attention's a2a_chunks); None: ``overlap``
    a2a_overlap: float | None = None
    gpus_per_nic: int = 1  # GPUs sharing one inter-node NIC (1: rail-optimised)
    gpus_per_intra_link: int = 1  # GPUs sharing one intra-node link (1: NVSwitch, own lanes)
    # the offloads (trainer.state_offload / activation_offload; usp.planner.offload)
    host_mem_bytes: float = 256.0 * GiB  # host memory per node
    host_bw: float = 25.0e9  # bytes/s per GPU per direction, host <-> device (PCIe)
    host_adam_rate: float = 100.0e6  # fp32 params/s one rank's share of the host's AdamW updates

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if f.name in ("name", "overlap", "a2a_overlap"):
                continue
            val = getattr(self, f.name)
            if not isinstance(val, (int, float)) or isinstance(val, bool) or val <= 0:
                raise ValueError(
                    f"cluster {self.name!r}: {f.name} must be a positive number, got {val!r}"
                )
        for name in ("ranks_per_node", "nodes", "gpus_per_nic", "gpus_per_intra_link"):
            if int(getattr(self, name)) != getattr(self, name):
                raise ValueError(
                    f"cluster {self.name!r}: {name} must be a whole number, "
                    f"got {getattr(self, name)!r}"
                )
        for name in ("overlap", "a2a_overlap"):
            val = getattr(self, name)
            if (val is not None or name == "overlap") and not (
                    isinstance(val, (int, float)) and 0 <= val <= 1):
                raise ValueError(f"cluster {self.name!r}: {name} must be in [0, 1], got {val!r}")
        if not 0 < self.mfu <= 1:
            raise ValueError(f"cluster {self.name!r}: mfu must be in (0, 1], got {self.mfu}")

    @property
    def world(self) -> int:
        return self.nodes * self.ranks_per_node

    def link_bw(self, remote: bool, senders: int) -> float:
        """Bytes/s one GPU gets on the inter-node (``remote``) or intra-node link while
        ``senders`` GPUs of its node send over that kind of link at the same time."""
        bw, share = (
            (self.inter_bw, self.gpus_per_nic) if remote
            else (self.intra_bw, self.gpus_per_intra_link)
        )
        links = max(1, self.ranks_per_node // share)  # links of this kind per node
        return bw * min(1.0, links / max(1, senders))

    def replace(self, **changes) -> "ClusterSpec":
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)


def cluster_dir() -> Path:
    """``configs/cluster`` as the package ships it (``usp.config.files``)."""
    return CONFIG_DIR / "cluster"


# a2a_overlap: measured only where pipelined all-to-alls were timed; the host fields price
# only the offloads (a file without them gets the defaults above)
OPTIONAL_KEYS = {"a2a_overlap", "host_mem_bytes", "host_bw", "host_adam_rate"}


def load_cluster(name_or_path: str | Path, search_dir: str | Path | None = None) -> ClusterSpec:
    """Read a cluster YAML: a path, or a name looked up in ``search_dir`` (default
    ``cluster_dir()``). Unknown or missing keys raise ``ValueError``; only the keys in
    ``OPTIONAL_KEYS`` may be left out."""
    path = Path(name_or_path)
    if path.suffix not in (".yaml", ".yml"):
        path = Path(search_dir or cluster_dir()) / f"{name_or_path}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in path.parent.glob("*.yaml")) if path.parent.is_dir() else []
        raise ValueError(f"cluster config {path} not found; known clusters: {known}")
    raw = yaml.safe_load(path.read_text()) or {}
    fields = {f.name: f for f in dataclasses.fields(ClusterSpec)}
    unknown = sorted(set(raw) - set(fields))
    missing = sorted(set(fields) - set(raw) - OPTIONAL_KEYS)
    if unknown or missing:
        raise ValueError(
            f"cluster config {path}: unknown keys {unknown}, missing keys {missing}; "
            f"keys must be the ClusterSpec fields {list(fields)}"
        )
    kinds = {"str": str, "int": int, "float": float,
             "float | None": lambda v: None if v is None else float(v)}
    try:  # YAML 1.1 reads '450e9' as a string: coerce to the field's type
        vals = {k: kinds[fields[k].type](v) for k, v in raw.items()}
    except (TypeError, ValueError) as e:
        raise ValueError(f"cluster config {path}: {e}") from e
    return ClusterSpec(**vals)
