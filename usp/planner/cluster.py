"""Where ranks sit on a ``usp.config.ClusterSpec``: each layout's ulysses and ring groups
on the nodes (``rank_grid``, ``group_span``), by the mesh's own rule
(``usp.dims.placement.mesh_ranks``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..dims.placement import axis_groups, mesh_ranks, simulated_hosts
from ..rules import check_degrees


# ---- where ranks sit -------------------------------------------------------------------


@dataclass(frozen=True)
class GroupSpan:
    """How one rank's ulysses or ring group lies on the nodes.

    ``local_peers``/``remote_peers``: other members on the same / on other nodes (what an
    all-to-all sends over each link); ``nodes``: distinct nodes in the group;
    ``crosses``: some ring hop (member i -> i+1) leaves the node.
    """

    size: int
    nodes: int
    local_peers: int
    remote_peers: int
    crosses: bool
    # busiest node, all groups of the axis communicating at once: how many of its ranks
    # send to a peer on the same node / on another node (ulysses: any such peer; ring:
    # the next member)
    intra_senders: int = 0
    inter_senders: int = 0


def rank_grid(
    dp: int, ring: int, ulysses: int, ranks_per_node: int, placement: str = "ulysses_inner"
) -> list[list[list[int]]]:
    """Global ranks as a nested [dp][ring][ulysses] list, ranks node-major
    (node n holds ranks n*K .. n*K+K-1 for K = ranks_per_node)."""
    world = dp * ring * ulysses
    check_degrees(world, ulysses, ring, dp)
    if world % ranks_per_node and ranks_per_node < world:
        raise ValueError(
            f"world size {world} is not a whole number of nodes of {ranks_per_node} GPUs"
        )
    return mesh_ranks(simulated_hosts(world, ranks_per_node), dp, ring, ulysses, placement)


def group_span(
    dp: int, ring: int, ulysses: int, ranks_per_node: int, axis: str, placement: str,
    expert: int = 1,
) -> GroupSpan:
    """Worst-placed group along ``axis`` ('ulysses', 'ring' or 'expert': the ``expert``
    consecutive ranks of the flattened [dp, ring, ulysses] grid, an all-to-all group like
    ulysses): most remote peers, with the sender counts of the busiest node (``GroupSpan``)."""
    if axis not in ("ulysses", "ring", "expert"):
        raise ValueError(f"axis must be 'ulysses', 'ring' or 'expert', got {axis!r}")
    grid = rank_grid(dp, ring, ulysses, ranks_per_node, placement)
    if axis == "expert":
        flat = [rank for plane in grid for row in plane for rank in row]
        groups = [flat[i:i + expert] for i in range(0, len(flat), expert)]
    else:
        groups = axis_groups(grid, axis)
    worst = None
    intra: dict[int, int] = {}  # node -> ranks sending inside it
    inter: dict[int, int] = {}  # node -> ranks sending off it
    for g in groups:
        node = [r // ranks_per_node for r in g]
        for m, n in enumerate(node):
            local = sum(1 for x in node if x == n) - 1
            if axis != "ring":  # an all-to-all
                sends_local, sends_remote = local > 0, local < len(g) - 1
            else:
                nxt = node[(m + 1) % len(g)]
                sends_local, sends_remote = len(g) > 1 and nxt == n, nxt != n
            intra[n] = intra.get(n, 0) + sends_local
            inter[n] = inter.get(n, 0) + sends_remote
            span = GroupSpan(
                size=len(g),
                nodes=len(set(node)),
                local_peers=local,
                remote_peers=len(g) - 1 - local,
                crosses=any(node[i] != node[(i + 1) % len(g)] for i in range(len(g))),
            )
            if worst is None or span.remote_peers > worst.remote_peers:
                worst = span
    return dataclasses.replace(worst, intra_senders=max(intra.values()),
                               inter_senders=max(inter.values()))
