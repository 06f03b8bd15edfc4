"""A clean exit: SPMesh.close() frees every group the mesh made before the default group goes,
and a mesh never closed is released at interpreter exit, before the shutdown starts.

Gloo worker threads that outlive ``dist.destroy_process_group()`` into the interpreter's
shutdown can abort it ("terminate called without an active exception"); see the comment
above ``SPMesh.close``.
"""

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from usp import SequenceLayout, SPMesh
from usp.launch import free_port, spawn_local

ROOT = Path(__file__).resolve().parents[1]
NO_CLOSE_SCRIPT = ROOT / "tests" / "no_close_script.py"
EXAMPLE_RUNS = 5  # torchrun launches of the example; each takes ~10 s on 2 cores
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


@pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun not on PATH")
def test_library_example_exits_cleanly(tmp_path):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_"))}
    cmd = ["torchrun", "--standalone", "--nproc-per-node", "4",
           str(ROOT / "examples" / "library_example.py")]
    for run in range(EXAMPLE_RUNS):
        res = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, env=env,
                             timeout=300, check=False)
        assert "terminate called" not in res.stderr, (run, res.stderr[-3000:])
        assert res.returncode == 0, (run, res.stderr[-3000:])
        assert "matches dense attention" in res.stdout, (run, res.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts threads in /proc")
def test_unclosed_mesh_is_released_before_interpreter_shutdown(tmp_path):
    # 4 ranks of a script that never closes its two meshes and ends with only
    # dist.destroy_process_group(); its last atexit handler (the last Python code before
    # finalization) must find every gloo worker joined and both meshes released. Before
    # the release at exit: 8-10 workers per rank and the kept mesh open, every run.
    world, port = 4, free_port()
    base = {k: v for k, v in os.environ.items()
            if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_"))}
    base.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world),
                OMP_NUM_THREADS="1",
                PYTHONPATH=os.pathsep.join(filter(None, (str(ROOT),
                                                         base.get("PYTHONPATH")))))
    procs = [subprocess.Popen([sys.executable, str(NO_CLOSE_SCRIPT)], cwd=tmp_path,
                              env={**base, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(world)]
    results = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=240)
            results.append((p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for rank, (rc, out, err) in enumerate(results):
        assert "terminate called" not in err, (rank, err[-3000:])
        assert rc == 0, (rank, rc, err[-3000:])
        check = [line for line in out.splitlines() if line.startswith("exit-check")]
        assert check, (rank, out, err[-3000:])
        fields = dict(f.split("=") for f in check[-1].split()[1:])
        assert fields["workers"] == "0", (rank, check[-1])
        assert fields["kept"] == "closed", (rank, check[-1])
        assert fields["local"] in ("gone", "closed"), (rank, check[-1])
