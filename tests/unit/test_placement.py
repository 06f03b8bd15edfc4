"""``usp.dims.placement``: the rank grid from host names, placement and degrees, one
process (topology, not rank order, decides the groups)."""

import pytest

from usp.dims.placement import axis_groups, mesh_ranks, node_order, spanning_groups


def test_mesh_ranks_pure():
    hosts = ["n0", "n0", "n1", "n1"]
    assert mesh_ranks(hosts, 1, 2, 2, "ulysses_inner") == [[[0, 1], [2, 3]]]
    assert mesh_ranks(hosts, 1, 2, 2, "ring_inner") == [[[0, 2], [1, 3]]]
    # hosts interleaved by rank: topology, not rank order, decides the groups
    assert mesh_ranks(["a", "b", "a", "b"], 1, 2, 2) == [[[0, 2], [1, 3]]]
    # 2 nodes x 4 ranks, u=2 r=2 dp=2: each SP group fits in one node
    assert mesh_ranks(["x"] * 4 + ["y"] * 4, 2, 2, 2) == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]
    # ring_inner with dp: ring groups are consecutive ranks of one node
    assert mesh_ranks(["x"] * 4 + ["y"] * 4, 2, 2, 2, "ring_inner") == [
        [[0, 2], [1, 3]], [[4, 6], [5, 7]]]
    with pytest.raises(ValueError, match="3 hosts listed for dp 1 x ring 2 x ulysses 2 = 4"):
        mesh_ranks(["a"] * 3, 1, 2, 2)


def test_groups_along_each_axis():
    grid = mesh_ranks(["x"] * 4 + ["y"] * 4, 2, 2, 2)
    assert node_order(["b", "a", "b"]) == [[0, 2], [1]]
    assert axis_groups(grid, "ulysses") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert axis_groups(grid, "ring") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert axis_groups(grid, "dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    hosts = ["x"] * 4 + ["y"] * 4
    assert spanning_groups(grid, hosts, "dp") == axis_groups(grid, "dp")
    assert spanning_groups(grid, hosts, "ring") == []
