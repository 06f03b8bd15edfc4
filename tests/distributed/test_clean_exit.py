"""A clean exit: SPMesh.close() frees every group the mesh made before the default group goes
(4 gloo ranks). The library example and a script that never closes its mesh:
``e2e/test_clean_exit_scripts.py``.

Gloo worker threads that outlive ``dist.destroy_process_group()`` into the interpreter's
shutdown can abort it ("terminate called without an active exception"); see the comment
above ``SPMesh.close``.
"""

import os
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from usp import SequenceLayout, SPMesh
from usp.launch import spawn_local

GLOO_THREADS_PER_GROUP = 2  # torch 2.13 ProcessGroupGloo default worker threads


def _gloo_workers() -> int:
    """Live gloo worker threads (``pt_gloo_runloop``) in this process (Linux /proc)."""
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            names.append(Path(f"/proc/self/task/{task}/comm").read_text().strip())
        except OSError:  # the thread ended while we looked
            pass
    return names.count("pt_gloo_runloop")


def _wait_for_workers(more_than: int, timeout_s: float = 5.0) -> int:
    """A new thread names itself once it runs: poll until more than ``more_than`` show."""
    deadline = time.monotonic() + timeout_s
    while (n := _gloo_workers()) <= more_than and time.monotonic() < deadline:
        time.sleep(0.01)
    return n


def _close_worker():
    # ulysses 2 x ring 2: sp and dp_sp span the world (the DeviceMesh reuses the default
    # group for them); ulysses 2 x dp 2: sp is a real subgroup, dp_sp the world
    for ulysses, ring in ((2, 2), (2, 1)):
        _close_and_refuse(ulysses, ring)


def _close_and_refuse(ulysses: int, ring: int):
    rank = dist.get_rank()
    only_default = GLOO_THREADS_PER_GROUP  # the default group's workers
    mesh = SPMesh.build(ulysses=ulysses, ring=ring, ranks_per_node=2)
    layout = SequenceLayout(mesh, seq_len=8 * mesh.sp_size, balance="zigzag")
    x = torch.arange(layout.seq_len, dtype=torch.float32).reshape(1, -1)  # [1, L]
    full = layout.gather(layout.shard(x, dim=1), dim=1)  # a collective on the sp group
    assert torch.equal(full, x)
    for axis in ("ulysses", "ring", "dp"):
        t = torch.ones(1)
        dist.all_reduce(t, group=mesh.group(axis))
        assert t.item() == getattr(mesh, axis)
    assert _wait_for_workers(more_than=only_default) > only_default  # the measure sees them

    mesh.close()
    assert mesh.closed and mesh.device_mesh is None and mesh.flat_meshes == {}
    # every subgroup was freed and its threads joined now, not at interpreter exit
    assert _gloo_workers() <= only_default, _gloo_workers()
    mesh.close()  # idempotent: no second barrier, nothing left to destroy
    for use in (lambda: mesh.group("ring"), lambda: mesh.submesh("sp"),
                lambda: mesh.ulysses_rank, lambda: layout.positions()):
        with pytest.raises(RuntimeError, match="SPMesh was closed"):
            use()
    assert "dp=" in mesh.describe() and mesh.ranks.numel() == dist.get_world_size()
    t = torch.ones(1)
    dist.all_reduce(t)  # the default group, which the mesh may reuse for sp/dp_sp, lives
    assert t.item() == dist.get_world_size()

    # the context manager closes on a normal exit and on an exception, on every rank
    with SPMesh.build(ulysses=ulysses, ring=ring, ranks_per_node=2) as m2:
        assert m2.group("ulysses") is not None
    assert m2.closed
    with (pytest.raises(ValueError, match=f"boom on rank {rank}"),
          SPMesh.build(ulysses=ulysses, ring=ring, ranks_per_node=2) as m3):
        raise ValueError(f"boom on rank {rank}")
    assert m3.closed
    assert _gloo_workers() <= only_default, _gloo_workers()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts threads in /proc")
def test_close_frees_groups_and_refuses_use():
    spawn_local(_close_worker, 4)
