"""A library script that never closes its SPMeshes, run per rank by ``test_clean_exit_scripts.py``.

Run as ``python tests/no_close_script.py`` once per rank with RANK, WORLD_SIZE, MASTER_ADDR
and MASTER_PORT set (env://), world size 4. It builds two SPMeshes, runs ``usp_attention``
and ``layout.gather`` (an all-gather of tensors Python made: the collective whose late
release aborted the interpreter's shutdown) on each, then calls only
``dist.destroy_process_group()``: no ``mesh.close()``, no ``with``.

``kept``: ulysses 2 x dp 2 (sp is a real subgroup), referenced by a module global until the
interpreter exits. ``local``: ulysses 2 x ring 2 (sp spans the world: the DeviceMesh reuses
the default group for it), built in a function's frame and dropped when it returns, as in
``examples/library_example.py``; its DeviceMeshes outlive it in their reference cycle.

The last atexit handler to run (registered first, before torch and usp are imported)
prints one line, ``exit-check workers=N kept=STATE local=STATE``: N the gloo worker threads
(``pt_gloo_runloop``) still alive, each STATE ``gone``, ``closed`` or ``open``; what the
interpreter's finalization would meet.
"""

import atexit
import os
import time
import weakref

_REFS: dict[str, weakref.ref] = {}  # kept / local -> weakref to that SPMesh


def _gloo_workers() -> int:
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                names.append(f.read().strip())
        except OSError:  # the thread ended while we looked
            pass
    return names.count("pt_gloo_runloop")


def _state(name: str) -> str:
    mesh = _REFS[name]() if name in _REFS else None
    return "gone" if mesh is None else ("closed" if mesh.closed else "open")


def _exit_check() -> None:
    # a joined thread can show in /proc for a moment after pthread_join returned (the
    # kernel wakes the joiner before it removes the task): allow it that moment
    deadline = time.monotonic() + 3.0
    while (workers := _gloo_workers()) and time.monotonic() < deadline:
        time.sleep(0.01)
    print(f"exit-check workers={workers} kept={_state('kept')} "
          f"local={_state('local')}", flush=True)


atexit.register(_exit_check)  # registered first: runs after every handler usp registers

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from usp import SequenceLayout, SPMesh, usp_attention  # noqa: E402

B, L, H, D = 1, 32, 2, 8
KEPT = []  # the script's own module-level reference to its ``kept`` mesh


def _use(mesh: SPMesh) -> None:
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, L, H, D) for _ in range(3))
    layout = SequenceLayout(mesh, seq_len=L, balance="zigzag")
    out = usp_attention(*(layout.shard(t, dim=1) for t in (q, k, v)), mesh=mesh,
                        layout=layout, causal=True)
    assert layout.gather(out, dim=1).shape == (B, L, H, D)
    for axis in ("ulysses", "ring", "dp"):
        t = torch.ones(1)
        dist.all_reduce(t, group=mesh.group(axis))
        assert t.item() == getattr(mesh, axis)


def _local() -> None:
    mesh = SPMesh.build(ulysses=2, ring=2, ranks_per_node=2)
    _REFS["local"] = weakref.ref(mesh)
    _use(mesh)


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    kept = SPMesh.build(ulysses=2, ring=1, ranks_per_node=2)
    KEPT.append(kept)
    _REFS["kept"] = weakref.ref(kept)
    _use(kept)
    _local()
    dist.barrier()
    dist.destroy_process_group()  # and nothing else


if __name__ == "__main__":
    main()
