"""Releasing an ``SPMesh``'s process groups: at ``close()``, or at interpreter exit.

Why (torch 2.13, CPython 3.11, from a core dump of the abort): a gloo ProcessGroup runs
worker threads (``pt_gloo_runloop``) that are joined only when the ProcessGroup object is
freed; ``pg.shutdown()``, which ``dist.destroy_process_group()`` calls, leaves them running.
The groups an ``SPMesh`` made are held by its ``_cache`` and by the DeviceMesh's group
registry; the DeviceMesh sits in a root <-> flattened mesh cycle
(``compat.release_device_mesh``) and FSDP/DTensor state can keep it alive longer still, so
they live until interpreter shutdown. A worker drops its last reference to a finished
collective only after the caller's ``wait()`` has returned; when that collective
(``layout.gather``'s all_gather) holds tensors that Python created, the drop needs the GIL.
If the worker runs late on a busy machine, the main thread is already in ``Py_FinalizeEx``,
which answers the worker's GIL request with ``pthread_exit``; its forced unwind meets the
noexcept ``~AsyncAllgatherWork``: std::terminate, "terminate called without an active
exception", SIGABRT. Freeing the groups while the interpreter is alive joins the workers
first (the ProcessGroup's pybind holder, IntrusivePtrNoGilDestructor, releases the GIL while
it joins, so a worker waiting for it can finish). A mesh never closed is released by
``_release_unclosed_at_exit``, an ``atexit`` handler: atexit handlers run in
``Py_FinalizeEx`` before it marks the interpreter finalizing, so a worker's GIL request is
still answered normally there.
"""

from __future__ import annotations

import atexit
import gc
import warnings
import weakref

import torch.distributed as dist

from .compat import process_group_alive, release_device_mesh


def destroy_groups(device_meshes) -> None:
    """``dist.destroy_process_group`` for every group of ``device_meshes`` (None entries
    skipped) but the default one, in reverse creation order, the same on every rank."""
    # this rank's groups of the mesh in creation order (dp, ring, ulysses, sp, dp_sp),
    # without the default group, which an axis spanning the whole world reuses
    found: list[dist.ProcessGroup] = []
    for pg in (g for dm in device_meshes if dm is not None for g in dm.get_all_groups()):
        if pg is not dist.group.WORLD and all(pg is not f for f in found):
            found.append(pg)
    for pg in reversed(found):  # the same order on every rank
        if process_group_alive(pg):  # not destroyed elsewhere
            dist.destroy_process_group(pg)


# ---- release at interpreter exit ----------------------------------------------------------

class Owned:
    """Weak references to an SPMesh and to the DeviceMeshes it made.

    The DeviceMeshes are followed on their own: once the SPMesh itself is freed (a script
    that keeps it in ``main()``'s frame), its root and flattened DeviceMeshes live on in
    their reference cycle, holding the groups, until a garbage collection.
    """

    _unclosed: dict[int, Owned] = {}  # by id(record); pruned of dead records on track()
    _handler_registered = False

    __slots__ = ("mesh", "device_meshes")

    def __init__(self, mesh) -> None:  # an SPMesh
        self.mesh = weakref.ref(mesh)
        self.device_meshes = [weakref.ref(dm)
                              for dm in [mesh.device_mesh, *mesh.flat_meshes.values()]]

    @classmethod
    def track(cls, mesh) -> Owned:  # an SPMesh
        for key, rec in list(cls._unclosed.items()):
            if rec.mesh() is None and all(r() is None for r in rec.device_meshes):
                del cls._unclosed[key]
        rec = cls(mesh)
        cls._unclosed[id(rec)] = rec
        if not cls._handler_registered:
            cls._handler_registered = True
            atexit.register(_release_unclosed_at_exit)
        return rec

    def untrack(self) -> None:
        self._unclosed.pop(id(self), None)

    def release(self) -> None:
        """Drop every reference the mesh and its DeviceMeshes hold to process groups."""
        mesh = self.mesh()
        if mesh is not None and not mesh._closed:
            mesh._closed = True
            mesh._drop_references()
        for ref in self.device_meshes:
            release_device_mesh(ref())


def _release_unclosed_at_exit() -> None:
    """``atexit``: release every SPMesh not closed, and the DeviceMeshes it made.

    No collective and no ``destroy_process_group`` here (a peer may be gone already): only
    references are dropped, then ``gc.collect()`` frees the DeviceMesh cycles. After the
    caller's ``dist.destroy_process_group()`` nothing else holds the groups, so they are
    freed, and their gloo workers joined, now, while the interpreter is intact. When the
    world was not destroyed, torch still holds the groups: then nothing changes for them.
    """
    records = list(Owned._unclosed.values())
    Owned._unclosed.clear()
    for rec in records:
        try:
            rec.release()
        except Exception as e:  # noqa: BLE001 - never fail the exit; say why instead
            warnings.warn(f"usp: releasing an SPMesh at exit failed: {e!r}", stacklevel=1)
    if records:
        gc.collect()
