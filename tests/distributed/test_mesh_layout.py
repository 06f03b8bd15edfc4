"""Mesh groups and token layout on 4 gloo processes (2 simulated nodes x 2). The rank grid
alone: ``unit/test_mesh_placement.py``."""

import warnings

import pytest
import torch
import torch.distributed as dist

from usp import SequenceLayout, SPMesh
from usp.dims.parallel import ParallelDims
from usp.launch import spawn_local


def _mesh_worker():
    rank = dist.get_rank()
    node = rank // 2
    # ulysses inside nodes, ring across (rail-aligned: same local rank)
    m = SPMesh.build(ulysses=2, ring=2, ranks_per_node=2)
    uly = dist.get_process_group_ranks(m.group("ulysses"))
    ring = dist.get_process_group_ranks(m.group("ring"))
    assert uly == [2 * node, 2 * node + 1], uly
    assert ring == [rank % 2, rank % 2 + 2], ring
    assert {m.hosts[r] for r in uly} == {f"sim-node{node}"}
    assert len({m.hosts[r] for r in ring}) == 2
    assert sorted(dist.get_process_group_ranks(m.group("sp"))) == [0, 1, 2, 3]
    assert (m.ring_rank, m.ulysses_rank) == (node, rank % 2)
    # groups by role: the axis that serves it (usp.dims.parallel.ROLES)
    assert m.group("sequence") is m.group("sp") and m.group("fsdp") is m.group("dp_sp")
    assert m.group("loss") is m.group("dp_sp") and m.group("batch") is m.group("dp")
    assert m.dims == ParallelDims(dp=1, ring=2, ulysses=2)

    # ring_inner: the reverse, and a warning that ulysses crosses nodes
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        m2 = SPMesh.build(ulysses=2, ring=2, ranks_per_node=2, placement="ring_inner")
    assert dist.get_process_group_ranks(m2.group("ring")) == [2 * node, 2 * node + 1]
    assert dist.get_process_group_ranks(m2.group("ulysses")) == [rank % 2, rank % 2 + 2]
    spans = [w for w in caught if "spans nodes" in str(w.message)]
    assert (len(spans) == 1) == (rank in (0, 1)), [str(w.message) for w in caught]
    if spans:
        assert "ranks per node (2)" in str(spans[0].message)

    # invalid layouts are refused before any collective runs
    def boom(*a, **k):
        raise AssertionError("a collective ran before validation")

    real = dist.all_gather_object
    dist.all_gather_object = boom
    try:
        for kw, needle in (
            (dict(ulysses=3, ring=1), "ulysses (3) x ring (1) = 3 does not divide world size 4"),
            (dict(ulysses=2, ring=2, dp=2), "dp (2) x ring (2) x ulysses (2) = 8 != world size 4"),
            (dict(ulysses=2, ring=2, placement="inner"), "placement"),
            (dict(ulysses=2, ring=1, ranks_per_node=3), "ranks_per_node=3 does not divide the 4 ranks"),
        ):
            with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace(")", r"\)")):
                SPMesh.build(**kw)
        with pytest.raises(ValueError, match=r"= 2 != world size 4; use ParallelDims"):
            SPMesh.from_dims(ParallelDims(dp=1, ring=1, ulysses=2))
    finally:
        dist.all_gather_object = real

    # real host discovery: one host here, so every group is on it
    m3 = SPMesh.build(ulysses=4, ring=1)
    assert len(set(m3.hosts)) == 1 and m3.dp == 1


def test_mesh_groups_two_simulated_nodes():
    spawn_local(_mesh_worker, 4)


def _layout_worker():
    rank = dist.get_rank()
    m = SPMesh.build(ulysses=2, ring=2, ranks_per_node=2)
    lay = SequenceLayout(m, seq_len=16, balance="zigzag")
    # 4 chunks of 4 tokens: ring 0 holds chunks 0 and 3, ring 1 chunks 1 and 2; each
    # ring segment is split contiguously over its two ulysses ranks
    zig = {0: [0, 1, 2, 3], 1: [12, 13, 14, 15], 2: [4, 5, 6, 7], 3: [8, 9, 10, 11]}
    assert lay.positions().tolist() == zig[rank]
    cont = SequenceLayout(m, seq_len=16, balance="contiguous")
    assert cont.positions().tolist() == list(range(4 * rank, 4 * rank + 4))
    # positions of all ranks form a permutation; shard -> gather is the identity
    allpos = [torch.empty(4, dtype=torch.long) for _ in range(4)]
    dist.all_gather(allpos, lay.positions())
    assert sorted(torch.cat(allpos).tolist()) == list(range(16))
    x = torch.arange(2 * 16 * 3, dtype=torch.float32).view(2, 16, 3)
    for layout in (lay, cont):
        piece = layout.shard(x, dim=1)
        assert piece.shape == (2, 4, 3)
        assert torch.equal(layout.gather(piece, dim=1), x)
    with pytest.raises(ValueError, match="expects 16 tokens on dim 1"):
        lay.shard(x[:, :8], dim=1)
    with pytest.raises(ValueError, match=r"18 is not divisible by 2 x ring x ulysses = 8"):
        SequenceLayout(m, seq_len=18)

    # a topology whose mesh order differs from process-group order (hosts b, a, a, b)
    m2 = SPMesh.build(ulysses=2, ring=2, hosts=["b", "a", "a", "b"])
    assert m2.to_group_rank("ring") is not None or m2.to_group_rank("sp") is not None
    lay2 = SequenceLayout(m2, seq_len=16)
    assert torch.equal(lay2.gather(lay2.shard(x, dim=1), dim=1), x)


def test_layout_zigzag_positions_and_roundtrip():
    spawn_local(_layout_worker, 4)
