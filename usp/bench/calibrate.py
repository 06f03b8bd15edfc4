"""Calibrate the planner's cost model on this machine: the measurements behind
``usp.planner.calibration``, taken on local gloo processes, and the command that prints
them beside the model's predictions and published figures.

    python -m usp.bench.calibrate                  # about 90 s on a 2-core box
    python -m usp.bench.calibrate --quick          # smoke test, about 30 s
    python -m usp.bench.calibrate --published-only # the published comparison, no processes


``measure(setup)`` spawns ``setup.nprocs`` processes (all at once, as in training) that
time: a small and a large ``all_to_all_single`` and ``batch_isend_irecv`` ring step, the
LSE merge (``usp.ring.merge``), how much of a ring transfer hides behind a kernel call,
three kernel probes (``usp.attention.local_attention``), and ``usp_attention``
forward+backward for every layout and length, each beside its *compute-only* replay (the
same ring code with ``LoopbackComm`` and no all-to-all). The probes and the attention
calls run round-robin in the same processes (``usp.bench.timing.round_robin``), so load
from other processes lands on all of them alike.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import torch
import torch.distributed as dist

from ..attention import usp_attention
from ..attention import local_attention
from ..kernels import get_kernel
from ..launch import spawn_local
from ..layout import SequenceLayout
from ..mesh import SPMesh
from ..planner.calibration import (FULL, PROBE, PROBE_NC, QUICK, STATS, CalibrationSetup,
                                   format_report)
from ..planner.published import SOURCES, format_published, published_rows
from ..ring import RingAttention, RingPlan, merge
from ..dims.heads import check_heads
from .timing import LoopbackComm, overlap_times, round_robin, timed


def _ring_step(nxt: int, prv: int, send: torch.Tensor, recv: torch.Tensor) -> list:
    """Post one ring step as ``usp.comm.RingComm`` does: send to next, receive from previous."""
    return dist.batch_isend_irecv([dist.P2POp(dist.isend, send, nxt),
                                   dist.P2POp(dist.irecv, recv, prv)])


def micro(setup: CalibrationSetup) -> dict:
    """Per-repetition slowest-rank seconds of the link, merge and overlap tests (every rank
    calls it), with the bytes each moves."""
    n, rank = dist.get_world_size(), dist.get_rank()
    out = {}
    # all-to-all: chunk bytes to each of n-1 peers; t = lat + (n-1) chunk / bw (the model's form)
    for tag, chunk, reps in (("small", 1024, 30), ("large", setup.a2a_kib * 1024, 8)):
        x = torch.randn(n * chunk // 4)
        y = torch.empty_like(x)
        out[f"a2a_{tag}_s"] = timed(lambda x=x, y=y: dist.all_to_all_single(y, x), reps)
        out[f"a2a_{tag}_bytes"] = (n - 1) * chunk
    nxt, prv = (rank + 1) % n, (rank - 1) % n
    for tag, nbytes, reps in (("small", 1024, 30), ("large", setup.p2p_kib * 1024, 8)):
        s = torch.randn(nbytes // 4)
        r = torch.empty_like(s)
        out[f"p2p_{tag}_s"] = timed(
            lambda s=s, r=r: [q.wait() for q in _ring_step(nxt, prv, s, r)], reps)
        out[f"p2p_{tag}_bytes"] = nbytes
    # merge of one block into the fp32 accumulator: [1, S, H, d], the model counts 3 fp32 passes
    S, H, d = 2048, 8, 64
    acc, lse = torch.randn(1, S, H, d), torch.randn(1, H, S)
    blk, blk_lse = torch.randn(1, S, H, d), torch.randn(1, H, S)
    out["merge_s"] = timed(lambda: merge(acc, lse, blk, blk_lse), 10)
    out["merge_bytes"] = 3 * 4 * S * H * d
    # overlap: a ring transfer posted, a kernel call, then the wait (what each ring step does)
    q, k, v = (torch.randn(1, 2048, 2, 64) for _ in range(3))
    s = torch.randn(setup.p2p_kib * 1024 // 4)
    r = torch.empty_like(s)

    def kernel():
        with torch.no_grad():
            local_attention(q, k, v, causal=True)

    out["ovl_kernel_s"], out["ovl_comm_s"], out["ovl_both_s"] = overlap_times(
        kernel, lambda: _ring_step(nxt, prv, s, r), setup.overlap_reps)
    return out


def _probes(d: int) -> list:
    """(name, fn) of the kernel probes: ``PROBE`` causal forward and forward+backward,
    ``PROBE_NC`` non-causal forward+backward."""
    pq, pk, pv, pdo = (torch.randn(1, PROBE[0], PROBE[1], d, requires_grad=i < 3)
                       for i in range(4))
    nq, nk, nv, ndo = (torch.randn(1, PROBE_NC[0], PROBE_NC[1], d, requires_grad=i < 3)
                       for i in range(4))

    def probe_fwd():
        with torch.no_grad():
            local_attention(pq, pk, pv, causal=True)

    def fwd_bwd(q, k, v, do, causal):
        for t in (q, k, v):
            t.grad = None
        local_attention(q, k, v, causal=causal).backward(do)

    return [("kernel fwd", probe_fwd),
            ("kernel fwd+bwd", lambda: fwd_bwd(pq, pk, pv, pdo, True)),
            ("kernel fwd+bwd non-causal", lambda: fwd_bwd(nq, nk, nv, ndo, False))]


def prepare_entries(setup: CalibrationSetup, meshes: dict) -> list:
    """Timed entries (name, fn): the kernel probes and, per length and layout, the full
    ``usp_attention`` call and its compute-only replay. ``meshes``: (u, r) -> SPMesh."""
    B, H, Hkv, d = setup.batch, setup.heads, setup.kv_heads, setup.head_dim
    kernel, entries = get_kernel("torch"), _probes(setup.head_dim)
    g = torch.Generator().manual_seed(0)
    for L in setup.seq_lens:
        q, dout = (torch.randn(B, L, H, d, generator=g) for _ in range(2))
        k, v = (torch.randn(B, L, Hkv, d, generator=g) for _ in range(2))
        for (u, r), mesh in meshes.items():
            layout = SequenceLayout(mesh, seq_len=L, balance=setup.balance)
            ins = [layout.shard(t, dim=1).detach().clone().requires_grad_(True) for t in (q, k, v)]
            dl = layout.shard(dout, dim=1).detach().clone()

            def full(ins=ins, dl=dl, mesh=mesh, layout=layout):
                for t in ins:
                    t.grad = None
                usp_attention(*ins, mesh=mesh, layout=layout, causal=True,
                              kernel="torch").backward(dl)

            kv = check_heads(H, Hkv, u)  # [B, L/r, H/u | kv, d]: what the ring sees after the a2a
            loc = [torch.randn(B, L // r, h, d).requires_grad_(True) for h in (H // u, kv, kv)]
            ldo = torch.randn(B, L // r, H // u, d)

            def local(loc=loc, ldo=ldo, mesh=mesh, r=r):
                for t in loc:
                    t.grad = None
                plan = RingPlan(mesh.ring_rank, r, L // r, True, setup.balance)
                RingAttention.apply(*loc, LoopbackComm(), plan, kernel, d ** -0.5).backward(ldo)

            entries += [(f"usp L={L} u={u} r={r}", full), (f"local L={L} u={u} r={r}", local)]
    return entries


def run_rank(setup: CalibrationSetup, raw_path: str) -> None:
    """Every rank: ``micro`` then the round-robin entries; rank 0 writes
    ``{"micro": ..., "rounds": {entry: [seconds per round]}}`` to ``raw_path``."""
    rank = dist.get_rank()
    say = print if rank == 0 else (lambda *a, **k: None)
    say(f"micro-measurements on {dist.get_world_size()} processes x "
        f"{torch.get_num_threads()} threads ...", flush=True)
    res = dict(micro=micro(setup))
    with ExitStack() as stack:  # each mesh closed on leaving (no barrier after an error)
        meshes = {(u, r): stack.enter_context(SPMesh.build(ulysses=u, ring=r))
                  for u, r in setup.layouts}
        entries = prepare_entries(setup, meshes)
        say(f"{len(entries)} timed entries x (warmup {setup.warmup} + {setup.iters} rounds), "
            "round-robin ...", flush=True)
        times = round_robin(
            [fn for _, fn in entries], setup.iters, warmup=setup.warmup,
            on_round=lambda i: say(f"  round {i + 1}/{setup.iters}" if i >= 0 else "  warmup",
                                   flush=True))
    res["rounds"] = {name: [t[j] for t in times] for j, (name, _) in enumerate(entries)}
    if rank == 0:
        Path(raw_path).write_text(json.dumps(res))
    dist.barrier()


def measure(setup: CalibrationSetup) -> dict:
    """Run ``run_rank`` on ``setup.nprocs`` local gloo processes; its result plus
    ``loadavg`` (the 1-minute load average before and after) and ``wall_s``."""
    with tempfile.TemporaryDirectory() as tmp:
        raw = os.path.join(tmp, "raw.json")
        t0, load0 = time.perf_counter(), os.getloadavg()[0]
        spawn_local(run_rank, setup.nprocs, setup, raw, threads=setup.threads)
        res = json.loads(Path(raw).read_text())
    res["loadavg"] = [load0, os.getloadavg()[0]]
    res["wall_s"] = time.perf_counter() - t0
    return res


# ---- the command ---------------------------------------------------------------------


def _ints(text: str, sep: str = ",") -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(sep))
    except ValueError:
        raise ValueError(f"{text!r} is not integers separated by {sep!r}") from None


def parse_args(argv=None) -> tuple[argparse.Namespace, CalibrationSetup]:
    p = argparse.ArgumentParser(description="Calibrate the planner's cost model on this machine.")
    p.add_argument("--nprocs", type=int, default=4)
    p.add_argument("--seq-lens", type=_ints, default=None,
                   help=f"global lengths, comma-separated (default {FULL['seq_lens']})")
    p.add_argument("--layouts", default="4x1,2x2,1x4", help="ULYSSESxRING, comma-separated")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=None, help="default: --heads")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--balance", choices=("zigzag", "contiguous"), default="zigzag")
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--iters", type=int, default=None, help="timed rounds")
    p.add_argument("--threads", type=int, default=None, help="default: CPUs // nprocs, >= 1")
    p.add_argument("--a2a-kib", type=int, default=4096, help="large all-to-all: KiB per peer")
    p.add_argument("--p2p-kib", type=int, default=16384, help="large ring step: KiB sent")
    p.add_argument("--stat", choices=sorted(STATS), default="min",
                   help="how repeated times are summarized (default min: load only adds time)")
    p.add_argument("--overlap-reps", type=int, default=7, help="rounds of the overlap test")
    p.add_argument("--quick", action="store_true", help=f"smoke test: {QUICK}")
    p.add_argument("--published-only", action="store_true", help="no measurement")
    p.add_argument("--json", type=Path, default=None, help="write all results here")
    args = p.parse_args(argv)
    preset = QUICK if args.quick else FULL
    if args.threads is None:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        args.threads = max(1, (cpus or 1) // args.nprocs)
    try:
        setup = CalibrationSetup(
            nprocs=args.nprocs, threads=args.threads,
            seq_lens=args.seq_lens or preset["seq_lens"],
            layouts=tuple(_ints(item.lower(), "x") for item in args.layouts.split(",")),
            batch=args.batch, heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim,
            balance=args.balance,
            warmup=preset["warmup"] if args.warmup is None else args.warmup,
            iters=preset["iters"] if args.iters is None else args.iters,
            a2a_kib=args.a2a_kib, p2p_kib=args.p2p_kib, overlap_reps=args.overlap_reps)
    except ValueError as e:
        p.error(str(e))
    return args, setup


def main(argv=None) -> None:
    args, setup = parse_args(argv)
    out = {}
    if not args.published_only:
        res = measure(setup)
        text, out = format_report(setup, res, args.stat)
        print(text)
        out["raw"], out["wall_s"] = res, res["wall_s"]
        print(f"(measured in {res['wall_s']:.0f} s; 1-minute load average {res['loadavg'][0]:.1f}"
              f" before, {res['loadavg'][1]:.1f} after, on {os.cpu_count()} CPUs)")
    rows = published_rows()
    print("\n== published figures vs the model (relative figures; specs: published_specs()) ==")
    print(format_published(rows))
    print("\nsources:\n  " + "\n  ".join(SOURCES))
    if args.json:
        out["published"] = rows
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2, default=str))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
