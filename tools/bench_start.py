"""How long ``spawn_local`` takes to start N gloo ranks, forked from the forkserver (what it
does) against spawned (what it did until 2026-12-05), interleaved in one process.

    python -m tools.bench_start                 # 4 ranks, 3 rounds
    python -m tools.bench_start --ranks 2 --rounds 5

Each call starts the ranks, joins them in one process group, all-reduces once and tears the
group down; the launcher has imported usp's training path and used its own intra-op threads
first, as a test process has. The first forkserver call includes the server's start (it
imports usp once); it is printed apart.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import usp.train.phase_runner  # noqa: F401  (the launcher has usp imported, as pytest has)
from usp.launch import local


def _all_reduce_once() -> None:
    t = torch.ones(4)
    dist.all_reduce(t)
    assert t[0] == dist.get_world_size()


def _spawned(ranks: int) -> None:
    mp.start_processes(local._worker, args=(ranks, local.free_port(), 1, "cpu", _all_reduce_once,
                                            (), 60.0), nprocs=ranks, join=True,
                       start_method="spawn")


def _timed(fn, *args) -> float:
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args(argv)
    torch.set_num_threads(2)
    (torch.randn(512, 512) @ torch.randn(512, 512)).sum().item()
    first = _timed(local.spawn_local, _all_reduce_once, a.ranks)
    print(f"forkserver, first call (starts the server): {first:.2f} s")
    forked, spawned = [], []
    for _ in range(a.rounds):
        forked.append(_timed(local.spawn_local, _all_reduce_once, a.ranks))
        spawned.append(_timed(_spawned, a.ranks))
    print(f"{a.ranks} ranks, {a.rounds} rounds: forked {' '.join(f'{t:.2f}' for t in forked)} s;"
          f" spawned {' '.join(f'{t:.2f}' for t in spawned)} s; median ratio "
          f"{sorted(s / f for s, f in zip(spawned, forked))[a.rounds // 2]:.1f}x")


if __name__ == "__main__":
    main()
