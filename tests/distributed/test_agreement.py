"""Ranks that call the library with different arguments get an error naming them, not a hang
or a silently different result."""

import pytest
import torch
import torch.distributed as dist

from usp import SequenceLayout, SPMesh, usp_attention
from usp.launch import spawn_local


def _expect(fn, *needles):
    try:
        fn()
    except ValueError as e:
        for n in needles:
            assert n in str(e), (n, str(e))
        return
    raise AssertionError(f"rank {dist.get_rank()}: no ValueError")


def _disagreeing_worker():
    rank = dist.get_rank()
    # degrees per rank: (1, 2) on rank 0, (2, 1) on rank 1 -> refused on both, named
    _expect(lambda: SPMesh.build(ulysses=1 + rank, ring=2 - rank),
            "ranks disagree on SPMesh.build", "ranks [0]: (1, 2", "ranks [1]: (2, 1")
    with SPMesh.build(ulysses=1, ring=2) as mesh:  # agreeing ranks still build
        layout = SequenceLayout(mesh, seq_len=16)
        q, k, v = (torch.randn(1, 8, 2, 8) for _ in range(3))
        # causal differs per rank: a silently wrong result before, an error now
        _expect(lambda: usp_attention(q, k, v, mesh=mesh, layout=layout, causal=rank == 0),
                "ranks disagree on usp_attention", "True", "False")
        out = usp_attention(q, k, v, mesh=mesh, layout=layout, causal=True)
        assert out.shape == q.shape


@pytest.mark.timeout(120)
def test_ranks_that_disagree_are_named():
    spawn_local(_disagreeing_worker, 2, timeout_s=60)
