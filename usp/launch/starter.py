"""How ``spawn_local`` starts its ranks: forked from multiprocessing's forkserver, which
imported torch and usp once, instead of each rank importing them afresh.

A spawned rank imports torch and usp's trainer again: about 5 CPU-seconds each, so 10 s of
wall time for 4 ranks on a 2-core machine. A rank forked from the server starts in well under
a second. The server itself never ran torch code, so a rank it forks inherits no OpenMP
thread pool (forking a launcher that used more than one OpenMP thread hangs a child that
uses more than one) and no CUDA context.

What a spawned rank takes from its launcher at the moment it starts, and a forked one would
take from the server instead, is sent along with the rank's arguments (``FromLauncher``):
the environment and the standard output and error. The working directory and ``sys.path``
multiprocessing sends itself.

The server outlives a signal sent to every process of a job (a terminal's or a scheduler's
``kill`` of the process group, ``scancel --signal``): it ignores ``JOB_SIGNALS``
(``usp.launch.serving``, which only the server imports), so it is still there to report each
rank's exit code to the launcher; a rank takes back the default handlers as it starts. It
ends with the launcher (it reads the launcher's end on a pipe), and a rank with it
(``PR_SET_PDEATHSIG``, ``usp.launch.local``). The server imports the launcher's own usp: it starts with the
folder that holds it first on ``PYTHONPATH`` (the server does not take the launcher's
``sys.path``), and a rank checks it got that usp.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
from multiprocessing import forkserver, reduction
from pathlib import Path

# usp.launch.serving: the server ignores JOB_SIGNALS; usp.train.phase_runner: torch,
# torch.distributed, FSDP and usp's whole training path
PRELOAD = ["usp.launch.serving", "usp.train.phase_runner"]
# what a job's processes get together: sent on to every rank by ``run_local``, ignored by the
# server (SIGINT is multiprocessing's own: the server ignores it, a rank takes it back)
JOB_SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2")


def start_method() -> str:
    """``forkserver`` where the platform has it (Linux, macOS), else ``spawn``; the server
    preloads ``PRELOAD`` (set before it first starts, once per launcher process)."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return "spawn"
    multiprocessing.get_context("forkserver").set_forkserver_preload(PRELOAD)
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, (_usp_root(), old)))
    try:
        forkserver.ensure_running()  # a no-op once it runs
    finally:
        if old is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = old
    return "forkserver"


def server_pid() -> int | None:
    """The running forkserver's process id (the parent of the ranks it forks), or None."""
    return getattr(forkserver._forkserver, "_forkserver_pid", None)


def server_ignores() -> list[signal.Signals]:
    """``JOB_SIGNALS`` this platform has but SIGINT (multiprocessing's server ignores that
    one itself and gives its ranks Python's handler back)."""
    return [getattr(signal, n) for n in JOB_SIGNALS if n != "SIGINT" and hasattr(signal, n)]


def _usp_root() -> str:
    """The folder the running usp package sits in."""
    return str(Path(sys.modules["usp"].__file__).resolve().parents[1])


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def _adopt(env: dict, streams: dict, usp_root: str) -> None:
    """In the rank, while its arguments are unpickled: the launcher's environment and
    standard streams replace the server's."""
    if _usp_root() != usp_root:
        raise RuntimeError(f"the forkserver imported usp from {_usp_root()}, the launcher runs "
                           f"it from {usp_root}: start the launcher where that usp is first on "
                           f"sys.path, or set PYTHONPATH={usp_root}")
    os.environ.clear()
    os.environ.update(env)
    for sig in server_ignores():
        signal.signal(sig, signal.SIG_DFL)
    _leave_server()
    for target, dup in streams.items():
        fd = dup.detach()
        if fd != target:
            os.dup2(fd, target)
            os.close(fd)


def _leave_server() -> None:
    """In a forked rank: close the server's keep-alive pipe it inherited (multiprocessing
    hands it on so that a rank could fork from the same server). The server ends when every
    holder has closed it: with the ranks holding none, it ends with the launcher, even a
    SIGKILLed one, and takes its ranks with it (``PR_SET_PDEATHSIG``). A rank that starts
    processes of its own from a forkserver gets a server of its own."""
    server = forkserver._forkserver
    if server._forkserver_alive_fd is not None:
        os.close(server._forkserver_alive_fd)
        server._forkserver_alive_fd = server._forkserver_address = None


class FromLauncher:
    """The launcher's environment and standard output/error as they are when the rank
    starts (pickled then). Put among a forkserver rank's arguments; unpickled it is None,
    having set them in the rank."""

    def __reduce__(self):
        streams = {fd: reduction.DupFd(fd) for fd in (1, 2) if _is_open(fd)}
        return _adopt, (dict(os.environ), streams, _usp_root())
