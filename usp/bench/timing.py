"""Timing loops shared by the measurement tools, run by every rank of a gloo group.

Each timed call sits between barriers and its time is the slowest rank's (an
``all_reduce`` with ``MAX`` over the per-rank times), so one rank's delay is counted
once for all. ``LoopbackComm`` replaces the ring transport to time the ring's compute alone.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist


def default_threads(nprocs: int) -> int:
    """The CPUs this process may run on, shared by ``nprocs`` processes (at least 1)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cpus or 1) // nprocs)


class LoopbackComm:
    """Stands in for ``usp.comm.RingComm``: every block 'arrives' as the one sent, so the
    ring runs all its kernel calls and merges with no transfer (blocks have the same
    shapes, so the work is the same)."""

    def start(self, send: torch.Tensor, tag: int = 0) -> _Arrived:
        return _Arrived(send)


class _Arrived:
    """The handle ``LoopbackComm.start`` returns: ``wait()`` gives back the sent tensor."""

    def __init__(self, t: torch.Tensor):
        self.recv = t

    def wait(self) -> torch.Tensor:
        return self.recv


def _slowest(times: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(times, op=dist.ReduceOp.MAX)  # per entry: the slowest rank's seconds
    return times


def mean_over_ranks(values: list) -> list:
    """``values`` (nested lists of floats, the same shape on every rank) averaged over the
    ranks of the default group."""
    if not values:
        return values
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t)
    return (t / dist.get_world_size()).tolist()


def time_ratios(times: Sequence[float], base: Sequence[float]) -> dict:
    """``times`` / ``base``, both measured in the same rounds: by mean, median, min, and the
    median of per-round ratios (``paired_median``: cancels load that drifts from round to
    round)."""
    a, b = (torch.tensor(x, dtype=torch.float64) for x in (times, base))
    return dict(mean=(a.mean() / b.mean()).item(), median=(a.median() / b.median()).item(),
                min=(a.min() / b.min()).item(), paired_median=(a / b).median().item())


def timed(fn: Callable[[], object], reps: int) -> list[float]:
    """The slowest rank's seconds for each of ``reps`` calls of ``fn()`` (all ranks call it)."""
    ts = torch.zeros(reps, dtype=torch.float64)
    for i in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        ts[i] = time.perf_counter() - t0
    return _slowest(ts).tolist()


def round_robin(fns: Sequence[Callable[[], object]], rounds: int, warmup: int = 0,
                rotate: bool = True, on_round: Callable[[int], None] | None = None
                ) -> list[list[float]]:
    """Slowest rank's seconds of every ``fns[j]()`` in each of ``rounds`` rounds:
    ``out[i][j]``. Each round calls every entry once, between barriers; with ``rotate``
    round ``i`` starts at entry ``i mod len(fns)`` so no entry always runs first.
    ``warmup`` untimed rounds come first; ``on_round(i)`` runs after each round
    (``i < 0`` for warmup rounds)."""
    n = len(fns)
    ts = torch.zeros(rounds, n, dtype=torch.float64)
    for it in range(-warmup, rounds):
        start = it % n if rotate else 0
        for j in list(range(start, n)) + list(range(start)):
            dist.barrier()
            t0 = time.perf_counter()
            fns[j]()
            t1 = time.perf_counter()
            if it >= 0:
                ts[it, j] = t1 - t0
        if on_round is not None:
            on_round(it)
    return _slowest(ts).tolist()


def overlap_times(kernel: Callable[[], object], post: Callable[[], Sequence], reps: int,
                  warmup: int = 0) -> tuple[list[float], list[float], list[float]]:
    """Slowest rank's seconds of ``kernel()`` alone, of a transfer alone (``post()`` returns
    its requests, which are then waited on) and of both (post, kernel, wait: what each
    ring step does), the three timed back to back ``reps`` times. For
    ``usp.planner.calibration.overlap_share``."""

    def transfer(beside=None):
        reqs = post()
        if beside is not None:
            beside()
        for x in reqs:
            x.wait()

    fns = (kernel, transfer, lambda: transfer(beside=kernel))
    for _ in range(warmup):
        for fn in fns:
            fn()
    per_round = round_robin(fns, reps, rotate=False)  # [reps][3], interleaved like the rounds
    kernel_s, comm_s, both_s = (list(col) for col in zip(*per_round, strict=True))
    return kernel_s, comm_s, both_s
