"""The balance benchmark's corpus and its timed ring (``tools.bench_balance``).

Corpus: the ``.py`` files of a Python standard library (site-packages left out, empty
files skipped), in path order, one byte token each plus one EOS: only the document
lengths matter, for both the counted work and the timing (q, k, v are random).

Timing: two ring ranks (one thread each) run a ring attention forward + backward of the
same rows under the document mask, ``zigzag`` and ``per_document`` interleaved round by
round (``usp.bench.timing.round_robin``: the slowest rank's wall time per call, and the
busiest rank's process CPU time); each row's plan built inside the timed call (``call``)
or once and reused (``reuse``, as ``usp_attention`` reuses a layout's plans).
"""

from __future__ import annotations

import json
import os
import sysconfig
import tempfile

import torch

from usp.bench.balance import BALANCES, row_plan


def stdlib_root() -> str:
    return sysconfig.get_paths()["stdlib"]


def stdlib_doc_lens(root: str) -> list[int]:
    """Byte length + 1 (EOS) of every non-empty ``.py`` file under ``root``, path order."""
    lens = []
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x != "site-packages")
        for f in sorted(files):
            n = os.path.getsize(os.path.join(d, f)) if f.endswith(".py") else 0
            if n:
                lens.append(n + 1)
    return lens


def _worker(rows, heads: int, head_dim: int, rounds: int, path: str, plans: tuple) -> None:
    import time

    import torch.distributed as dist

    from usp.bench.timing import round_robin
    from usp.comm import RingComm
    from usp.kernels import get_kernel
    from usp.mesh import SPMesh
    from usp.ring import RingAttention

    with SPMesh.build(ring=2) as mesh:
        comm = RingComm(mesh.axis_ranks("ring"), mesh.ring_rank, mesh.group("ring"), mesh.comm)
        kernel, gen = get_kernel("torch"), torch.Generator().manual_seed(mesh.rank)
        n = sum(rows[0]) // 2
        q, k, v, dout = (torch.randn(1, n, heads, head_dim, generator=gen) for _ in range(4))
        variants = [(b, p) for p in plans for b in BALANCES]
        kept, cpu = {}, {j: [] for j in range(len(variants))}

        def plan_of(i, balance, mode):
            if mode == "call":  # built in the call, as each layer did before plans were kept
                return row_plan(rows[i], 2, balance, mesh.ring_rank)
            if (i, balance) not in kept:  # built once, reused by every later call
                kept[i, balance] = row_plan(rows[i], 2, balance, mesh.ring_rank)
            return kept[i, balance]

        def call(j):
            balance, mode = variants[j]

            def run():
                c0 = time.process_time()
                for i in range(len(rows)):
                    plan = plan_of(i, balance, mode)
                    x = [t.clone().requires_grad_() for t in (q, k, v)]
                    out = RingAttention.apply(*x, comm, plan, kernel, head_dim ** -0.5)
                    out.backward(dout)
                cpu[j].append(time.process_time() - c0)
            return run

        wall = round_robin([call(j) for j in range(len(variants))], rounds, warmup=1)
        used = torch.tensor([[cpu[j][1 + i] for j in range(len(variants))]
                             for i in range(rounds)], dtype=torch.float64)  # warmup dropped
        dist.all_reduce(used, op=dist.ReduceOp.MAX)  # the busiest rank's CPU seconds
        if dist.get_rank() == 0:
            with open(path, "w") as f:
                json.dump({"wall": wall, "cpu": used.tolist()}, f)
        dist.barrier()


def time_rows(rows, heads: int = 2, head_dim: int = 32, rounds: int = 5,
              plans: tuple = ("reuse",)) -> dict:
    """Seconds per round of the rows' ring forward + backward, for every (plans mode,
    balance) in that order (``BALANCES`` within each mode): ``out["wall"][i][j]`` the
    slowest rank's wall time of round i and variant j, ``out["cpu"][i][j]`` the busiest
    rank's process CPU time. Plans mode ``call``: each row's plan built inside the call;
    ``reuse``: built once (in the untimed warmup round) and reused, as ``usp_attention``
    reuses a ``DocumentLayout``'s plans across a model's layers (for both balances here)."""
    from usp.launch import spawn_local

    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        spawn_local(_worker, 2, rows, heads, head_dim, rounds, path, tuple(plans), threads=1)
        with open(path) as f:
            return json.load(f)
    finally:
        os.unlink(path)
