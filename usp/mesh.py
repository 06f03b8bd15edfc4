"""The ``dp x ring x ulysses`` mesh, built from where ranks actually run.

One object describes the sequence-parallel layout and owns its DeviceMesh and groups; it
is passed explicitly to whoever needs a group.

Topology: ranks are grouped by the host they run on (an all-gather of host names, or a
simulated ``ranks_per_node`` for tests and CPU runs), then laid out node-major. With the
default ``placement="ulysses_inner"`` the ulysses axis is innermost, so ulysses groups sit
inside a node and ring groups join the same local rank on different nodes (rail-aligned).
``placement="ring_inner"`` swaps the two, for experiments.
"""

from __future__ import annotations

import socket
import warnings
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from .comm import CommStats
from .validate import check_degrees, check_placement

AXES = ("dp", "ring", "ulysses")


def node_order(hosts: list[str]) -> list[list[int]]:
    """Group global ranks by host: nodes ordered by their lowest rank, ranks ascending."""
    nodes: dict[str, list[int]] = {}
    for rank, host in enumerate(hosts):
        nodes.setdefault(host, []).append(rank)
    return list(nodes.values())


def mesh_ranks(
    hosts: list[str], dp: int, ring: int, ulysses: int, placement: str = "ulysses_inner"
) -> torch.Tensor:
    """Global ranks arranged as a [dp, ring, ulysses] tensor for the given host of each rank."""
    order = torch.tensor([r for node in node_order(hosts) for r in node])
    if placement == "ulysses_inner":
        return order.reshape(dp, ring, ulysses)
    return order.reshape(dp, ulysses, ring).transpose(1, 2).contiguous()


def spanning_groups(ranks: torch.Tensor, hosts: list[str], axis: int) -> list[list[int]]:
    """Groups along ``axis`` of the [dp, ring, ulysses] rank tensor that span several hosts."""
    groups = ranks.movedim(axis, -1).reshape(-1, ranks.shape[axis]).tolist()
    return [g for g in groups if len({hosts[r] for r in g}) > 1]


@dataclass
class SPMesh:
    """A ``dp x ring x ulysses`` layout of the ranks and its process groups.

    Build with ``SPMesh.build(ulysses=..., ring=...)`` after ``dist.init_process_group``.
    ``ulysses_rank``/``ring_rank``/``dp_rank`` are this rank's mesh coordinates; the
    sequence-parallel rank is ``sp_rank = ring_rank * ulysses + ulysses_rank``.
    """

    ulysses: int
    ring: int
    dp: int
    placement: str
    ranks: torch.Tensor  # [dp, ring, ulysses] global ranks
    hosts: list[str]  # host of each global rank
    device_mesh: DeviceMesh | None = None
    flat_meshes: dict[str, DeviceMesh] = field(default_factory=dict)  # sp, dp_sp
    comm: CommStats = field(default_factory=CommStats)
    _cache: dict = field(default_factory=dict, repr=False)

    # ---- construction -------------------------------------------------------------
    @classmethod
    def build(
        cls,
        ulysses: int = 1,
        ring: int = 1,
        dp: int | None = None,
        placement: str = "ulysses_inner",
        ranks_per_node: int | None = None,
        hosts: list[str] | None = None,
        device_type: str | None = None,
    ) -> "SPMesh":
        """Discover hosts, lay ranks out and create the DeviceMesh (collective: all ranks call).

        Simulation, for tests and CPU runs: ``ranks_per_node`` makes nodes of that many
        consecutive ranks; ``hosts`` gives the host name of every rank explicitly.
        Invalid degrees raise ``ValueError`` before any collective runs.
        """
        if not dist.is_initialized():
            raise RuntimeError("SPMesh.build needs torch.distributed.init_process_group first")
        world = dist.get_world_size()
        dp = check_degrees(world, ulysses, ring, dp)
        check_placement(placement)
        if ranks_per_node is not None and (ranks_per_node < 1 or world % ranks_per_node):
            raise ValueError(
                f"ranks_per_node ({ranks_per_node}) must divide the world size ({world})"
            )
        if hosts is not None and len(hosts) != world:
            raise ValueError(f"hosts lists {len(hosts)} ranks but the world size is {world}")
        hosts = list(hosts) if hosts is not None else cls._discover_hosts(world, ranks_per_node)
        ranks = mesh_ranks(hosts, dp, ring, ulysses, placement)
        if device_type is None:
            device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
        dm = DeviceMesh(device_type, ranks, mesh_dim_names=AXES)
        flat = {"sp": dm[("ring", "ulysses")]._flatten("sp"), "dp_sp": dm._flatten("dp_sp")}
        mesh = cls(ulysses, ring, dp, placement, ranks, hosts, dm, flat)
        mesh._warn_if_ulysses_spans_nodes()
        return mesh

    @staticmethod
    def _discover_hosts(world: int, ranks_per_node: int | None) -> list[str]:
        if ranks_per_node is not None:
            return [f"sim-node{r // ranks_per_node}" for r in range(world)]
        hosts: list[str] = [""] * world
        dist.all_gather_object(hosts, socket.gethostname())
        return hosts

    def _warn_if_ulysses_spans_nodes(self) -> None:
        group = self.axis_ranks("ulysses")
        spans = sorted({self.hosts[r] for r in group})
        if len(spans) > 1 and self.rank == group[0]:  # one warning per crossing group
            per_node = len(node_order(self.hosts)[0])
            warnings.warn(
                f"ulysses group {group} spans nodes {spans}: "
                f"its all-to-all moves activations every layer over the inter-node link, "
                f"typically ~10x slower than NVLink. Keep ulysses_degree <= ranks per node "
                f"({per_node}) with placement='ulysses_inner' and put the rest on ring.",
                stacklevel=3,
            )

    # ---- coordinates ----------------------------------------------------------------
    @property
    def rank(self) -> int:
        return dist.get_rank()

    @property
    def coord(self) -> tuple[int, int, int]:
        """(dp, ring, ulysses) coordinate of this rank."""
        if "coord" not in self._cache:
            idx = (self.ranks == self.rank).nonzero()[0].tolist()
            self._cache["coord"] = (idx[0], idx[1], idx[2])
        return self._cache["coord"]

    @property
    def dp_rank(self) -> int:
        return self.coord[0]

    @property
    def ring_rank(self) -> int:
        return self.coord[1]

    @property
    def ulysses_rank(self) -> int:
        return self.coord[2]

    @property
    def sp_size(self) -> int:
        return self.ring * self.ulysses

    @property
    def sp_rank(self) -> int:
        return self.ring_rank * self.ulysses + self.ulysses_rank

    # ---- groups -----------------------------------------------------------------------
    def submesh(self, axis: str) -> DeviceMesh:
        """1-D DeviceMesh of ``axis``: dp, ring, ulysses, sp (= ring x ulysses) or dp_sp."""
        if axis in self.flat_meshes:
            return self.flat_meshes[axis]
        return self.device_mesh[axis]

    def group(self, axis: str) -> dist.ProcessGroup:
        """Process group of ``axis``: dp, ring, ulysses, sp (= ring x ulysses) or dp_sp."""
        key = ("group", axis)
        if key not in self._cache:  # slicing the DeviceMesh costs ~1 ms; asked every layer
            self._cache[key] = self.submesh(axis).get_group()
        return self._cache[key]

    def axis_ranks(self, axis: str) -> list[int]:
        """Global ranks of this rank's group on ``axis``, in mesh-coordinate order."""
        d, i, j = self.coord
        if axis == "ulysses":
            return self.ranks[d, i, :].tolist()
        if axis == "ring":
            return self.ranks[d, :, j].tolist()
        if axis == "dp":
            return self.ranks[:, i, j].tolist()
        if axis == "sp":
            return self.ranks[d].reshape(-1).tolist()
        raise ValueError(f"unknown axis {axis!r}")

    def to_group_rank(self, axis: str) -> list[int] | None:
        """Map mesh coordinate -> rank inside the process group, or None when equal."""
        if axis not in self._cache:  # asked on every attention call: computed once
            coord_ranks = self.axis_ranks(axis)
            group_ranks = dist.get_process_group_ranks(self.group(axis))
            perm = [group_ranks.index(r) for r in coord_ranks]
            self._cache[axis] = None if perm == list(range(len(perm))) else perm
        return self._cache[axis]

    def ring_neighbors(self) -> tuple[int, int]:
        """Global ranks (previous, next) on this rank's ring."""
        ranks, i = self.axis_ranks("ring"), self.ring_rank
        return ranks[(i - 1) % self.ring], ranks[(i + 1) % self.ring]

    def describe(self) -> str:
        """Text picture: one line per node with its ranks and their (ring, ulysses) coordinate."""
        lines = [
            f"SPMesh dp={self.dp} ring={self.ring} ulysses={self.ulysses} "
            f"placement={self.placement}"
        ]
        for node in node_order(self.hosts):
            cells = []
            for r in node:
                d, i, j = (self.ranks == r).nonzero()[0].tolist()
                cells.append(f"r{r}(dp{d},ring{i},uly{j})")
            lines.append(f"  {self.hosts[node[0]]}: " + " ".join(cells))
        return "\n".join(lines)
