"""``usp.mesh.mesh_ranks``: the rank grid from host names, placement and degrees, one
process (topology, not rank order, decides the groups)."""

from usp.mesh import mesh_ranks


def test_mesh_ranks_pure():
    hosts = ["n0", "n0", "n1", "n1"]
    assert mesh_ranks(hosts, 1, 2, 2, "ulysses_inner").tolist() == [[[0, 1], [2, 3]]]
    assert mesh_ranks(hosts, 1, 2, 2, "ring_inner").tolist() == [[[0, 2], [1, 3]]]
    # hosts interleaved by rank: topology, not rank order, decides the groups
    assert mesh_ranks(["a", "b", "a", "b"], 1, 2, 2).tolist() == [[[0, 2], [1, 3]]]
    # 2 nodes x 4 ranks, u=2 r=2 dp=2: each SP group fits in one node
    assert mesh_ranks(["x"] * 4 + ["y"] * 4, 2, 2, 2).tolist() == [
        [[0, 1], [2, 3]], [[4, 5], [6, 7]]
    ]
