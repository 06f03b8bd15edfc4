"""The balance benchmark's corpus and its timed ring (``tools.bench_balance``).

Corpus: the ``.py`` files of a Python standard library (site-packages left out, empty
files skipped), in path order, one byte token each plus one EOS: only the document
lengths matter, for both the counted work and the timing (q, k, v are random).

Timing: two ring ranks (one thread each) run a ring attention forward + backward of the
same rows under the document mask, ``zigzag`` and ``per_document`` interleaved round by
round (``usp.bench.timing.round_robin``, the slowest rank's time per call); each row's plan
is built inside the timed call, as ``usp_attention`` builds it.
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


def _worker(rows, heads: int, head_dim: int, rounds: int, path: str) -> None:
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

        def call(balance):
            def run():
                for docs in rows:  # the plan is built in the call, as usp_attention does
                    plan = row_plan(docs, 2, balance, mesh.ring_rank)
                    x = [t.clone().requires_grad_() for t in (q, k, v)]
                    out = RingAttention.apply(*x, comm, plan, kernel, head_dim ** -0.5)
                    out.backward(dout)
            return run

        times = round_robin([call(b) for b in BALANCES], rounds, warmup=1)
        if dist.get_rank() == 0:
            with open(path, "w") as f:
                json.dump(times, f)
        dist.barrier()


def time_rows(rows, heads: int = 2, head_dim: int = 32, rounds: int = 5) -> list[list[float]]:
    """Seconds per round (slowest rank) of the rows' ring forward + backward: out[i][j] for
    round i and balance ``BALANCES[j]``."""
    from usp.launch import spawn_local

    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        spawn_local(_worker, 2, rows, heads, head_dim, rounds, path, threads=1)
        with open(path) as f:
            return json.load(f)
    finally:
        os.unlink(path)
