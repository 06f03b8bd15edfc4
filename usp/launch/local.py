"""The local launch: ``spawn_local`` (N processes in one group) and ``run_local``, the
supervised launch that restarts all ranks after a fault, forwards preemption signals to them
and never leaves a rank running."""

from __future__ import annotations

import ctypes
import gc
import json
import multiprocessing.connection
import os
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..comm import PEER_LOST
from .device import BACKENDS
from .starter import JOB_SIGNALS, FromLauncher, server_pid, start_method


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, threads, device_type, fn, args, timeout_s=600.0, launcher=None):
    """One rank: ``launcher`` is ``starter.FromLauncher()`` when forked from the forkserver
    (it took the launcher's environment and streams as it was unpickled), else None."""
    torch.set_num_threads(threads)
    if device_type == "cuda":
        torch.cuda.set_device(rank)  # rank i drives cuda:i; set before NCCL binds a device
    dist.init_process_group(
        BACKENDS[device_type],
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=timeout_s),  # a collective a peer never joins fails after this
    )
    try:
        fn(*args)
        dist.barrier()  # nobody tears down the group while a peer still talks to it
    finally:
        # free meshes and models fn left in reference cycles now, so their gloo worker
        # threads are joined here and not during interpreter shutdown (see SPMesh.close)
        gc.collect()
        dist.destroy_process_group()


def threads_per_rank(device_type: str, nprocs: int, threads: int | None) -> int:
    """Check ``device_type``; torch intra-op threads per rank: ``threads``, else
    ``OMP_NUM_THREADS`` where the environment sets it (as torchrun honours it), else the CPUs
    shared evenly."""
    if device_type not in BACKENDS:
        raise ValueError(f"device_type must be cpu or cuda, got {device_type!r}")
    if threads is not None:
        return threads
    omp = os.environ.get("OMP_NUM_THREADS", "").strip()
    if omp:
        if not omp.isdigit() or int(omp) < 1:
            raise ValueError(f"OMP_NUM_THREADS={omp!r} is not a positive integer: set it to the "
                             "intra-op threads each rank should use (e.g. 1), or unset it to "
                             "share the CPUs evenly over the ranks")
        return int(omp)
    return max(1, (os.cpu_count() or 1) // nprocs)


def spawn_local(fn, world_size: int, *args, threads: int | None = None,
                device_type: str = "cpu", timeout_s: float = 600.0) -> None:
    """Call ``fn(*args)`` on ``world_size`` fresh processes joined in one process group.

    ``device_type="cpu"`` (default): gloo. ``"cuda"``: NCCL, rank i on ``cuda:i`` (pick it
    with ``choose_device``, which checks there are enough GPUs). ``fn`` must be importable
    (module level). A failure on any rank raises here with the rank's traceback.
    ``threads`` is torch's intra-op threads per process (default: the CPU count shared
    evenly, at least 1). ``timeout_s``: collective timeout of the group. No restarts, no
    signal forwarding: that is ``run_local``. The ranks are forked from a server that
    imported torch and usp once (``starter``), with this process's environment and streams.
    """
    threads = threads_per_rank(device_type, world_size, threads)
    method = start_method()
    mp.start_processes(
        _worker,
        args=(world_size, free_port(), threads, device_type, fn, args, timeout_s,
              FromLauncher() if method == "forkserver" else None),
        nprocs=world_size,
        join=True,
        start_method=method,
    )


# ---- supervised local launch: restarts, signal forwarding, no rank left behind ---------------

FORWARDED_SIGNALS = JOB_SIGNALS  # sent on to every rank by run_local
_SETTLE_S = 2.0  # after a rank lost its peer: how long the peer may take to report why


def _die_with_parent(parent: int) -> None:
    """Linux: the kernel SIGKILLs this rank when ``parent`` dies, even by SIGKILL: the
    launcher, or the forkserver that forked the rank (which ends with the launcher)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the launcher died before prctl took effect
        os._exit(1)


def _exit_code_of(e: BaseException) -> int | None:
    """The code of a deliberate exit: SystemExit(n), KeyboardInterrupt (130) or an exception
    carrying an int ``exit_code`` (the trainer's preemption); None for a fault."""
    if isinstance(e, SystemExit):
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    if isinstance(e, KeyboardInterrupt):
        return 128 + signal.SIGINT
    code = getattr(e, "exit_code", None)
    return code if isinstance(code, int) else None


def _rank_entry(rank: int, parent: int, report_dir: str, worker_args: tuple) -> None:
    _die_with_parent(parent)
    try:
        _worker(rank, *worker_args)
    except BaseException as e:  # the launcher reads what happened from the record
        code = _exit_code_of(e)
        kind = "refused" if isinstance(e, ValueError) else "exited" if code is not None else "raised"
        if kind != "exited":
            traceback.print_exc()
        first = (str(e).strip().splitlines() or [""])[0]
        Path(report_dir, f"{rank}.json").write_text(json.dumps(
            {"kind": kind, "error": f"{type(e).__name__}: {first}", "message": str(e)}))
        sys.stderr.flush()
        os._exit(1 if code is None else code)


def _describe(rank: int, exitcode: int, report_dir: str) -> tuple[str, str]:
    """(kind, one line) for a rank that ended with ``exitcode``: kind is refused / exited /
    raised / killed."""
    path = Path(report_dir, f"{rank}.json")
    if path.exists():
        rec = json.loads(path.read_text())
        return rec["kind"], f"rank {rank} {rec['kind']}: {rec['error']}"
    if exitcode < 0:
        return "killed", f"rank {rank} was killed by {signal.Signals(-exitcode).name}"
    return "raised", f"rank {rank} exited with code {exitcode}"


def _shell_code(exitcode: int) -> int:
    return 128 - exitcode if exitcode < 0 else exitcode  # killed by signal N -> 128 + N


def _kill(procs) -> None:
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join()


def _run_once(worker_args: tuple, nprocs: int, grace_s: float) -> tuple[int, str, str]:
    """Start ``nprocs`` ranks, wait for them; returns (exit code, kind, one line).

    kind: "ok"; "signal" (a forwarded signal ended the run; code = the ranks' code);
    "exited" (a rank exited on purpose, e.g. preempted); "refused" (ValueError);
    "raised" / "killed" (a fault: the attempt may be restarted).
    """
    method = start_method()  # forked from the preloaded server (starter), else spawned
    ctx = mp.get_context(method)
    forked = method == "forkserver"
    parent = server_pid() if forked else os.getpid()  # the ranks' parent process
    worker_args = (*worker_args, FromLauncher() if forked else None)
    received: list[int] = []
    procs = []

    def forward(signum, frame):
        received.append(signum)
        for p in procs:
            if p.pid is not None and p.exitcode is None:
                os.kill(p.pid, signum)

    names = [n for n in FORWARDED_SIGNALS if hasattr(signal, n)]
    main = threading.current_thread() is threading.main_thread()
    old = {n: signal.signal(getattr(signal, n), forward) for n in names} if main else {}
    with tempfile.TemporaryDirectory(prefix="usp-ranks-") as report_dir:
        try:
            for rank in range(nprocs):
                procs.append(ctx.Process(target=_rank_entry, daemon=False,
                                         args=(rank, parent, report_dir, worker_args)))
                procs[-1].start()
            first, deadline, settle = None, None, None  # first failure; end of waits
            while True:
                multiprocessing.connection.wait([p.sentinel for p in procs if p.is_alive()], 0.2)
                codes = [p.exitcode for p in procs]  # read once: a rank may end meanwhile
                still = [r for r, c in enumerate(codes) if c is None]
                ended = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
                if first is None and ended:
                    # a rank that lost its peer is a consequence; prefer the one that caused it
                    found = [(r, *_describe(r, c, report_dir)) for r, c in ended]
                    cause = [f for f in found if not PEER_LOST.search(f[2])]
                    if not cause and still and (settle is None or time.monotonic() < settle):
                        settle = settle or time.monotonic() + _SETTLE_S  # cause still reporting?
                        continue
                    first = (cause or found)[0]
                    if still and first[1] in ("raised", "killed"):
                        first = (*first[:2], f"{first[2]}; ranks {still} still running then "
                                             f"(did not answer) were killed")
                if deadline is None and (received or (first and first[1] == "exited")):
                    deadline = time.monotonic() + grace_s  # let peers checkpoint and exit
                if not still:
                    break
                if (first and first[1] != "exited" and not received) or (
                        deadline is not None and time.monotonic() > deadline):
                    _kill(procs)  # a peer of a failed rank would hang until its timeout
        finally:
            _kill(procs)  # nothing survives the launcher, even on an error here
            for n, h in old.items():
                signal.signal(getattr(signal, n), h)
        codes = [_shell_code(p.exitcode) for p in procs]
        code = next((c for c in codes if c), 0)
        if received:
            sig = signal.Signals(received[0]).name
            return code, "signal", f"{sig} forwarded to {nprocs} ranks; they exited with {code}"
        if first is None:
            return 0, "ok", ""
        return (_shell_code(procs[first[0]].exitcode), *first[1:])


def run_local(fn, nprocs: int, *args, max_restarts: int = 0, device_type: str = "cpu",
              timeout_s: float = 600.0, threads: int | None = None, grace_s: float = 30.0,
              log=print) -> int:
    """Run ``fn(*args)`` on ``nprocs`` local ranks in one process group, supervised.

    - A fault (a rank raises, or is killed, e.g. by SIGKILL or the OOM killer): every
      other rank is killed at once, then ALL ranks are started again on a fresh
      rendezvous (new port), at most ``max_restarts`` times, one log line per restart.
      ``fn`` resumes from its last complete checkpoint (the trainer does, from run_dir).
    - A ``ValueError`` in a rank is a refusal: re-raised here, never retried.
    - SIGTERM/SIGINT/SIGUSR1/SIGUSR2 sent to this process are forwarded to every rank; the ranks
      get ``grace_s`` to checkpoint and exit (then are killed) and their exit code is
      returned, without restart. So is the code of a rank that exits on purpose
      (``SystemExit(n)`` or an exception with an int ``exit_code``, e.g. preemption).
    - ``timeout_s``: collective timeout; a peer that never joins a collective fails the
      attempt after it, named in the error (``naming_collectives`` names the axis too).
    - No rank outlives this call, nor this process (Linux: PR_SET_PDEATHSIG).

    Returns 0 or the ranks' exit code; raises ``RuntimeError`` naming the last failure
    after ``max_restarts`` restarts. ``fn`` must be importable (module level).
    """
    threads = threads_per_rank(device_type, nprocs, threads)
    if max_restarts < 0 or timeout_s <= 0:
        raise ValueError(f"need max_restarts >= 0 and timeout_s > 0, got {max_restarts} and "
                         f"{timeout_s}; e.g. trainer.max_restarts=0 trainer.timeout_s=600")
    for attempt in range(max_restarts + 1):
        worker_args = (nprocs, free_port(), threads, device_type, fn, args, timeout_s)
        code, kind, line = _run_once(worker_args, nprocs, grace_s)
        if kind in ("ok", "signal", "exited"):
            if line:
                log(f"usp: {line}")
            return code
        if kind == "refused":
            raise ValueError(line)
        if attempt < max_restarts:
            log(f"usp: restart {attempt + 1}/{max_restarts}: attempt {attempt} failed: {line}")
    raise RuntimeError(f"{nprocs} ranks failed {max_restarts + 1} times "
                       f"(trainer.max_restarts={max_restarts}); last: {line}")
