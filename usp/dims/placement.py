"""Rank placement: where each global rank sits in the ``[dp, ring, ulysses]`` grid.

Pure (no process group): ``SPMesh`` builds its DeviceMesh from ``mesh_ranks`` on the hosts
it discovered; the planner lays out a cluster spec's nodes with the same function
(``simulated_hosts``), so what it prices is what the mesh builds.

Ranks are grouped by the host they run on, nodes ordered by their lowest rank, then laid
out node-major. ``placement="ulysses_inner"`` (default) puts the ulysses axis innermost,
so ulysses groups sit inside a node and ring groups join the same local rank on different
nodes (rail-aligned); ``placement="ring_inner"`` swaps the two, for experiments.
"""

from __future__ import annotations

from ..rules import check_placement

AXES = ("dp", "ring", "ulysses")

Grid = list[list[list[int]]]  # [dp][ring][ulysses] global ranks


def node_order(hosts: list[str]) -> list[list[int]]:
    """Group global ranks by host: nodes ordered by their lowest rank, ranks ascending."""
    nodes: dict[str, list[int]] = {}
    for rank, host in enumerate(hosts):
        nodes.setdefault(host, []).append(rank)
    return list(nodes.values())


def simulated_hosts(world: int, ranks_per_node: int) -> list[str]:
    """Host names of ``world`` ranks on nodes of ``ranks_per_node`` consecutive ranks."""
    return [f"sim-node{r // ranks_per_node}" for r in range(world)]


def mesh_ranks(hosts: list[str], dp: int, ring: int, ulysses: int,
               placement: str = "ulysses_inner") -> Grid:
    """Global ranks arranged as a nested [dp][ring][ulysses] list, for the host of each rank
    (``hosts[r]``, one entry per rank: ``dp * ring * ulysses`` of them)."""
    check_placement(placement)
    order = [r for node in node_order(hosts) for r in node]
    if len(order) != dp * ring * ulysses:
        raise ValueError(f"{len(order)} hosts listed for dp {dp} x ring {ring} x ulysses "
                         f"{ulysses} = {dp * ring * ulysses} ranks; list one host per rank")
    if placement == "ulysses_inner":  # rank at (d, i, j) is order[(d * ring + i) * u + j]
        return [[order[(d * ring + i) * ulysses:(d * ring + i + 1) * ulysses]
                 for i in range(ring)] for d in range(dp)]
    # ring_inner: rank at (d, i, j) is order[(d * ulysses + j) * ring + i]
    return [[[order[(d * ulysses + j) * ring + i] for j in range(ulysses)]
             for i in range(ring)] for d in range(dp)]


def axis_groups(grid: Grid, axis: str) -> list[list[int]]:
    """Every group along ``axis`` (dp, ring or ulysses) of ``grid``, members in coordinate
    order; groups ordered by the other two coordinates."""
    dp, ring, ulysses = len(grid), len(grid[0]), len(grid[0][0])
    if axis == "ulysses":
        return [row for plane in grid for row in plane]
    if axis == "ring":
        return [[plane[i][j] for i in range(ring)] for plane in grid for j in range(ulysses)]
    if axis == "dp":
        return [[grid[d][i][j] for d in range(dp)] for i in range(ring) for j in range(ulysses)]
    raise ValueError(f"axis must be one of {AXES}, got {axis!r}")


def spanning_groups(grid: Grid, hosts: list[str], axis: str) -> list[list[int]]:
    """The groups along ``axis`` of ``grid`` whose members run on several hosts."""
    return [g for g in axis_groups(grid, axis) if len({hosts[r] for r in g}) > 1]
