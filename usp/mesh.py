"""The ``dp x ring x ulysses`` mesh, built from where ranks actually run.

One object describes the sequence-parallel layout and owns its DeviceMesh and groups; it
is passed explicitly to whoever needs a group.

What the mesh is, is data decided before it: ``usp.dims.parallel.ParallelDims`` (degrees,
placement, a2a stages, message fragments, axes by role). Where each rank sits is
``usp.dims.placement.mesh_ranks`` on the hosts the ranks report (an all-gather of host
names, or a simulated ``ranks_per_node`` for tests and CPU runs).
"""

from __future__ import annotations

import gc
import socket
import warnings
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from .comm import GLOO_FRAGMENT_BYTES, CommStats, check_agreement
from .compat import flatten_mesh, release_device_mesh
from .dims.parallel import ROLES, ParallelDims
from .dims.placement import AXES, mesh_ranks, node_order, simulated_hosts, spanning_groups
from .mesh_exit import Owned, destroy_groups
from .rules import check_ranks_per_node


@dataclass
class SPMesh:
    """A ``dp x ring x ulysses`` layout of the ranks and its process groups.

    Build with ``SPMesh.build(ulysses=..., ring=...)`` (or ``SPMesh.from_dims(dims)``) after
    ``dist.init_process_group``; ``dims`` (``ParallelDims``) holds the degrees and settings.
    ``ulysses_rank``/``ring_rank``/``dp_rank`` are this rank's mesh coordinates; the
    sequence-parallel rank is ``sp_rank = ring_rank * ulysses + ulysses_rank``.

    The mesh also carries how its ulysses all-to-alls travel, which ``usp_attention`` reads:
    ``a2a_chunks`` (pipeline stages: an int, or ``"auto"``, see
    ``usp.dims.stages.default_a2a_chunks``), and how messages of each axis travel:
    ``fragment_bytes_for(axis)``, the largest message fragment, or None for whole messages
    (see ``build``). Groups are asked by axis (dp, ring, ulysses, sp, dp_sp) or by role
    (batch, sequence, loss, fsdp: ``usp.dims.parallel``).

    ``mesh.close()`` (or a ``with SPMesh.build(...) as mesh:`` block) before
    ``dist.destroy_process_group()`` frees its groups at once; a mesh left open is released
    when the interpreter exits, before its shutdown starts (see ``close`` for why).
    """

    dims: ParallelDims
    ranks: torch.Tensor  # [dp, ring, ulysses] global ranks
    hosts: list[str]  # host of each global rank
    device_mesh: DeviceMesh | None = None
    flat_meshes: dict[str, DeviceMesh] = field(default_factory=dict)  # sp, dp_sp
    comm: CommStats = field(default_factory=CommStats)
    _cache: dict = field(default_factory=dict, repr=False)
    _closed: bool = field(default=False, repr=False)
    _owned: Owned | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.device_mesh is not None:  # released at interpreter exit unless closed first
            self._owned = Owned.track(self)

    # ---- the dims -----------------------------------------------------------------
    @property
    def ulysses(self) -> int:
        return self.dims.ulysses

    @property
    def ring(self) -> int:
        return self.dims.ring

    @property
    def dp(self) -> int:
        return self.dims.dp

    @property
    def placement(self) -> str:
        return self.dims.placement

    @property
    def a2a_chunks(self) -> int | str:
        """Pipeline stages of the ulysses all-to-alls: an int, or ``"auto"``."""
        return self.dims.a2a_chunks

    @property
    def fragment_bytes(self) -> int | str | None:
        return self.dims.fragment_bytes

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
        a2a_chunks: int | str = "auto",
        fragment_bytes: int | str | None = "auto",
    ) -> "SPMesh":
        """``from_dims`` of ``ParallelDims`` for this world (collective: all ranks call).

        ``dp`` is derived when None. ``a2a_chunks``: the attention calls' pipeline depth (an
        int, or ``"auto"``: 1 while every ulysses group stays inside a host, else pipelined;
        usp-train passes the planner's count). ``fragment_bytes``: ``"auto"`` cuts the
        ulysses and ring messages of an axis whose groups cross hosts over gloo into
        fragments of ``comm.GLOO_FRAGMENT_BYTES`` (large two-way TCP exchanges run under the
        link rate), and sends the others whole; an int sets the fragment size everywhere,
        None never cuts. Invalid degrees raise ``ValueError`` before any collective runs.
        """
        if not dist.is_initialized():
            raise RuntimeError("SPMesh.build needs torch.distributed.init_process_group first")
        dims = ParallelDims.for_world(dist.get_world_size(), ulysses, ring, dp,
                                      placement=placement, a2a_chunks=a2a_chunks,
                                      fragment_bytes=fragment_bytes)
        return cls.from_dims(dims, ranks_per_node, hosts, device_type)

    @classmethod
    def from_dims(cls, dims: ParallelDims, ranks_per_node: int | None = None,
                  hosts: list[str] | None = None, device_type: str | None = None) -> "SPMesh":
        """Discover hosts, lay ranks out and create the DeviceMesh of ``dims`` (collective:
        all ranks call, with the same arguments; checked before any group is made).

        Simulation, for tests and CPU runs: ``ranks_per_node`` makes nodes of that many
        consecutive ranks; ``hosts`` gives the host name of every rank explicitly.
        ``device_type``: the DeviceMesh's (default: cuda under NCCL, else cpu).
        """
        if not dist.is_initialized():
            raise RuntimeError("SPMesh.from_dims needs torch.distributed.init_process_group "
                               "first")
        world = dist.get_world_size()
        if dims.world != world:
            raise ValueError(f"dp ({dims.dp}) x ring ({dims.ring}) x ulysses ({dims.ulysses}) "
                             f"= {dims.world} != world size {world}; use ParallelDims."
                             f"for_world({world}, ...) or SPMesh.build")
        check_ranks_per_node(world, ranks_per_node)
        if hosts is not None and len(hosts) != world:
            raise ValueError(f"hosts lists {len(hosts)} ranks but the world size is {world}")
        # different degrees per rank would build mismatched groups and hang: agree first
        d = dims
        check_agreement("SPMesh.build(ulysses, ring, dp, placement, ranks_per_node, hosts, "
                        "a2a_chunks, fragment_bytes)",
                        (d.ulysses, d.ring, d.dp, d.placement, ranks_per_node, hosts,
                         d.a2a_chunks, d.fragment_bytes))
        hosts = list(hosts) if hosts is not None else cls._discover_hosts(world, ranks_per_node)
        ranks = torch.tensor(mesh_ranks(hosts, d.dp, d.ring, d.ulysses, d.placement))
        if device_type is None:
            device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
        dm = DeviceMesh(device_type, ranks, mesh_dim_names=AXES)
        # dp_sp (FSDP's, the loss's) in rank order: FSDP shards by its group's rank, and a
        # DTensor labels its shard by the mesh coordinate; under ring_inner the flattened
        # [dp, ring, ulysses] order is not the rank order, and DCP and the rank-by-rank load
        # would read the shards under each other's labels
        flat = {"sp": flatten_mesh(dm[("ring", "ulysses")], "sp"),
                "dp_sp": DeviceMesh(device_type, torch.arange(world), mesh_dim_names=("dp_sp",))}
        mesh = cls(dims, ranks, hosts, dm, flat)
        mesh._warn_if_ulysses_spans_nodes()
        return mesh

    @staticmethod
    def _discover_hosts(world: int, ranks_per_node: int | None) -> list[str]:
        if ranks_per_node is not None:
            return simulated_hosts(world, ranks_per_node)
        hosts: list[str] = [""] * world
        dist.all_gather_object(hosts, socket.gethostname())
        return hosts

    def crosses_hosts(self, axis: str) -> bool:
        """Whether some group of ``axis`` (dp, ring, ulysses) spans several hosts (real or
        simulated)."""
        if axis not in AXES:
            raise ValueError(f"crosses_hosts takes an axis of {AXES}, got {axis!r}")
        key = ("crosses", axis)
        if key not in self._cache:  # asked on every attention call: computed once
            self._cache[key] = bool(spanning_groups(self.ranks.tolist(), self.hosts, axis))
        return self._cache[key]

    @property
    def ulysses_crosses_hosts(self) -> bool:
        """Whether some ulysses group of the mesh spans several hosts."""
        return self.crosses_hosts("ulysses")

    def fragment_bytes_for(self, axis: str) -> int | None:
        """The largest fragment of one message to one peer on ``axis`` (ulysses or ring), or
        None when messages go whole: ``fragment_bytes`` when it is a number; for ``"auto"``,
        ``comm.GLOO_FRAGMENT_BYTES`` when the axis's groups cross hosts over gloo."""
        if self.fragment_bytes != "auto":
            return self.fragment_bytes
        key = ("fragments", axis)
        if key not in self._cache:  # asked on every attention call: decided once
            gloo = self.crosses_hosts(axis) and dist.get_backend(self.group(axis)) == "gloo"
            self._cache[key] = GLOO_FRAGMENT_BYTES if gloo else None
        return self._cache[key]

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
        self._check_open()
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
        return self.dims.sp

    @property
    def sp_rank(self) -> int:
        return self.ring_rank * self.ulysses + self.ulysses_rank

    # ---- groups -----------------------------------------------------------------------
    def submesh(self, axis: str) -> DeviceMesh:
        """1-D DeviceMesh of ``axis``: dp, ring, ulysses, sp (= ring x ulysses) or dp_sp, or
        of the axis that serves a role (batch, sequence, loss, fsdp)."""
        self._check_open()
        axis = ROLES.get(axis, axis)
        if axis in self.flat_meshes:
            return self.flat_meshes[axis]
        return self.device_mesh[axis]

    def group(self, axis: str) -> dist.ProcessGroup:
        """Process group of ``axis``: dp, ring, ulysses, sp (= ring x ulysses) or dp_sp, or
        of the axis that serves a role (batch, sequence, loss, fsdp)."""
        self._check_open()
        key = ("group", ROLES.get(axis, axis))
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

    def agree_once(self, what: str, value, axis: str = "sp") -> None:
        """``check_agreement`` over ``axis`` the first time this rank passes ``value``
        (collective then; free afterwards): a cheap guard for per-call arguments."""
        key = ("agreed", axis, value)
        if key not in self._cache:
            check_agreement(what, value, self.group(axis))
            self._cache[key] = True

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

    # ---- teardown (why: usp.mesh_exit) ---------------------------------------------
    def close(self, barrier: bool = True) -> None:
        """Release the DeviceMesh and every process group this mesh created.

        Collective (all ranks call, before ``dist.destroy_process_group()``):

        1. a barrier on the default group, so that no peer still uses a subgroup
           (skipped with ``barrier=False``, or once the default group is gone);
        2. ``dist.destroy_process_group(g)`` for each group of the mesh axes and of the
           flattened ``sp``/``dp_sp`` meshes, in reverse creation order; the default
           group, which the DeviceMesh reuses for an axis that spans the whole world,
           is left to the caller;
        3. drops the DeviceMesh's group registry and flattened meshes, this mesh's caches
           and references, then ``gc.collect()``, so the group objects are freed (and
           gloo joins its worker threads) now rather than at interpreter exit.

        Idempotent. Afterwards ``group``, ``submesh`` and the coordinates raise
        ``RuntimeError``; the degrees, ``ranks``, ``hosts``, ``comm`` and ``describe()``
        stay readable.
        """
        if self._closed:
            return
        self._closed = True
        if self._owned is not None:
            self._owned.untrack()
        if dist.is_initialized():  # False when the caller destroyed the world first
            if barrier:
                dist.barrier()  # every rank is past its last collective on the subgroups
            destroy_groups([self.device_mesh, *self.flat_meshes.values()])
        self._drop_references()
        gc.collect()  # DeviceMesh objects sit in reference cycles: free them now

    def _drop_references(self) -> None:
        for dm in [self.device_mesh, *self.flat_meshes.values()]:
            release_device_mesh(dm)
        self.device_mesh = None
        self.flat_meshes = {}
        self._cache.clear()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(
                "this SPMesh was closed (mesh.close() or the end of its `with` block) and "
                "its process groups destroyed; build a new one with SPMesh.build(...)"
            )

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> SPMesh:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        # after an exception a peer may be blocked in another collective: a barrier here
        # would turn this rank's error into a hang, so only the local release runs
        self.close(barrier=exc_type is None)
