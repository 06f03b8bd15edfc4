"""A library script that never closes its SPMesh: one rank of it, for ``test_clean_exit.py``.

Run as ``python tests/no_close_script.py MODE`` once per rank with RANK, WORLD_SIZE,
MASTER_ADDR and MASTER_PORT set (env://), world size 4. It builds an SPMesh, runs
``usp_attention`` and ``layout.gather`` (an all-gather of tensors Python made: the
collective whose late release aborted the interpreter's shutdown), then calls only
``dist.destroy_process_group()``: no ``mesh.close()``, no ``with``.

MODE ``local``: the mesh lives in ``main()``'s frame, as in ``examples/library_example.py``
(ulysses 2 x ring 2: sp spans the world, the DeviceMesh reuses the default group for it).
MODE ``global``: the mesh stays referenced by a module global until the interpreter exits
(ulysses 2 x dp 2: sp is a real subgroup).

The last atexit handler to run (registered first, before torch and usp are imported)
prints one line: ``exit-check workers=N mesh=STATE``, N the gloo worker threads
(``pt_gloo_runloop``) still alive and STATE ``gone``, ``closed`` or ``open``: what the
interpreter's finalization would meet.
"""

import atexit
import os
import sys
import weakref

_MESH_REF = [None]  # weakref to the SPMesh


def _gloo_workers() -> int:
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                names.append(f.read().strip())
        except OSError:  # the thread ended while we looked
            pass
    return names.count("pt_gloo_runloop")


def _exit_check() -> None:
    mesh = _MESH_REF[0]() if _MESH_REF[0] is not None else None
    state = "gone" if mesh is None else ("closed" if mesh.closed else "open")
    print(f"exit-check workers={_gloo_workers()} mesh={state}", flush=True)


atexit.register(_exit_check)  # first registered: runs after every handler usp registers

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from usp import SequenceLayout, SPMesh, usp_attention  # noqa: E402

B, L, H, D = 1, 32, 2, 8
KEEP = []  # MODE global: the script's own module-level reference to its mesh


def main(mode: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    ulysses, ring = (2, 2) if mode == "local" else (2, 1)
    mesh = SPMesh.build(ulysses=ulysses, ring=ring, ranks_per_node=2)
    _MESH_REF[0] = weakref.ref(mesh)
    if mode == "global":
        KEEP.append(mesh)
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, L, H, D) for _ in range(3))
    layout = SequenceLayout(mesh, seq_len=L, balance="zigzag")
    out = usp_attention(*(layout.shard(t, dim=1) for t in (q, k, v)), mesh=mesh,
                        layout=layout, causal=True)
    full = layout.gather(out, dim=1)
    assert full.shape == (B, L, H, D)
    for axis in ("ulysses", "ring", "dp"):
        t = torch.ones(1)
        dist.all_reduce(t, group=mesh.group(axis))
    dist.barrier()
    dist.destroy_process_group()  # and nothing else


if __name__ == "__main__":
    main(sys.argv[1])
