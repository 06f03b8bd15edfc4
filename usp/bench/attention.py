"""Forward+backward time of one attention call: usp layouts side by side (and a peer's row).

    python -m usp.bench.attention                       # B=1 L=8192 H=8 d=64 causal fp32
    python -m usp.bench.attention --quick               # small, for a smoke test
    python -m usp.bench.attention --layouts 4x1,2x2 --kv-heads 4 --json out.json
    python -m usp.bench.attention --layouts 4x1 --a2a-chunks 1,2,4 --seq-len 2048
    torchrun --nproc-per-node 4 -m usp.bench.attention   # one rank per process of a launch

Runs N local CPU processes on gloo (or joins a torchrun group as one rank). Every measured
config lives in the same processes and the configs are interleaved round-robin over the
iterations (``usp.bench.timing.round_robin``: the starting config rotates each iteration),
so machine noise lands on all of them alike. One measurement is

    barrier -> t0 -> out = attn(q, k, v); out.backward(dout) -> t1

and the iteration's time is the max of ``t1 - t0`` over ranks (the slowest rank sets the
pace of a synchronous step). Rows:

- ``usp u=X r=Y``: ``usp_attention`` on ``SPMesh.build(ulysses=X, ring=Y)``; with
  ``a2a_chunks`` C > 1 (``--a2a-chunks``), rows ``usp u=X r=Y cC`` pipeline the ulysses
  all-to-alls over C head stages (one mesh per layout, shared by its rows);
- a peer's row, first when given (``AttentionBench.peer``, a picklable function every rank
  calls): another sequence-parallel implementation over all N ranks. The project's lab
  passes DeepSpeed-Ulysses (``python -m tools.bench_attention``); skipped with a message
  when the peer cannot run the shapes.

Every row calls the same local kernel (``kernel="torch"``, the aten CPU flash op with
LSE). Inputs are one global [B, L, H, d] tensor drawn from a fixed seed; each config
shards it its own way (usp: ``SequenceLayout.shard``; a peer: its own slices). Before timing, every row's gathered output is compared with the
first row's, and so are the input gradients, so a fast but wrong config cannot hide in
the table (column ``max|diff|``). ``a2a exp``/``a2a hid``: ulysses all-to-all ms per call
(mean over ranks and rounds) waited for / travelling beside compute (``CommStats``'s
``exposed_s``/``hidden_s``); ``exp %``: exposed share of the row's mean; ``cpu ms``:
the process's CPU time per call (all its threads, gloo's included), mean over ranks and
rounds: when the processes outnumber the cores, wall time follows it, and a transfer can
only hide behind another rank's compute. ``vs peer``: mean / the peer's mean; the summary
adds the ratio of medians, of minima, and the median of per-round ratios, per
``a2a_chunks`` of the pure-ulysses layout.

Threads: every process uses ``threads`` intra-op threads (default: its CPUs / N, at least
1), the same for all configs, which share the processes.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from contextlib import ExitStack
from dataclasses import fields
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from ..attention import attention_stages, usp_attention
from ..launch import init_from_env, launcher_env, spawn_local
from ..layout import SequenceLayout
from ..mesh import SPMesh
from .attention_report import format_report, results
from .attention_setup import DTYPES, QUICK, AttentionBench, Row, parse_layouts  # noqa: F401
from .timing import mean_over_ranks, round_robin

# ---- one rank -----------------------------------------------------------------------------


def make_usp(bench: AttentionBench, mesh: SPMesh, chunks: int | str = 1, pieces: str = "auto"):
    """(row, shard, call, gather, comm stats) of ``usp_attention`` on ``mesh`` with
    ``a2a_chunks=chunks`` (``"auto"``: no count given, the mesh's default); ``pieces``
    names how ``mesh`` sends its messages ("auto" or "whole")."""
    layout = SequenceLayout(mesh, seq_len=bench.seq_len, balance=bench.balance)
    used = attention_stages(mesh, bench.heads, bench.kv_heads,
                            None if chunks == "auto" else chunks)

    def shard(x):  # [B, L, H, d] -> this rank's [B, L/P, H, d]
        return layout.shard(x, dim=1).detach().clone().requires_grad_(True)

    def call(ql, kl, vl):
        return usp_attention(ql, kl, vl, mesh=mesh, layout=layout, causal=bench.causal,
                             kernel="torch", a2a_chunks=None if chunks == "auto" else chunks)

    def gather(out):  # [B, L/P, H, d] -> [B, L, H, d]
        return layout.gather(out, dim=1)

    u, r = mesh.ulysses, mesh.ring
    variant = (f"auto(c{used})" if chunks == "auto" else f"c{chunks}") + (
        " whole" if pieces == "whole" else "")
    name = f"usp u={u} r={r}" + ("" if variant == "c1" else f" {variant}")
    return (Row(name, "usp", u, r, a2a_chunks=used, variant=variant), shard, call, gather,
            mesh.comm)


def _peer_config(bench: AttentionBench):
    """(config or None, skip reason or None, peer version or None); every rank agrees."""
    if bench.peer is None:
        return None, "no peer given (AttentionBench.peer)", None
    return bench.peer(bench)


def run_rank(bench: AttentionBench, result_path: str | None = None) -> dict | None:
    """One rank of the benchmark (every rank of the default group calls it).

    Returns the result on rank 0 (and writes it as JSON to ``result_path`` when given):
    ``args``, ``env``, ``rows`` (name, kind, degrees, ``times_ms``, ``max_abs_diff``, the
    stats and ``ratio_to_peer``), ``peer_skipped`` (the reason, or None) and
    ``usp_over_peer``: usp(u=N) / peer(u=N) by ``mean``, ``median``, ``min`` and
    ``paired_median`` (the median of per-round ratios) for the first pure-ulysses row (the
    first ``--a2a-chunks`` and ``--pieces`` given), or None; ``usp_over_peer_by_chunks``
    the same for every pure-ulysses row, by its variant ("c1", "auto(c4)", "c2 whole").
    None on other ranks.
    """
    rank = dist.get_rank()
    say = print if rank == 0 else (lambda *a, **k: None)
    dtype = DTYPES[bench.dtype]

    # one global problem, identical on every rank (fixed seed)
    g = torch.Generator().manual_seed(0)
    shape_q = (bench.batch, bench.seq_len, bench.heads, bench.head_dim)
    shape_kv = (bench.batch, bench.seq_len, bench.kv_heads, bench.head_dim)
    q = torch.randn(shape_q, generator=g).to(dtype)
    k = torch.randn(shape_kv, generator=g).to(dtype)
    v = torch.randn(shape_kv, generator=g).to(dtype)
    dout = torch.randn(shape_q, generator=g).to(dtype)

    with ExitStack() as meshes:  # closed before the caller tears the group down
        built = {key: meshes.enter_context(SPMesh.build(  # one mesh per layout and pieces
                     ulysses=key[0], ring=key[1],
                     fragment_bytes=None if key[2] == "whole" else "auto"))
                 for key in dict.fromkeys((u, r, pc) for u, r, _, pc in bench.usp_rows())}
        configs = [make_usp(bench, built[u, r, pc], c, pc) for u, r, c, pc in bench.usp_rows()]
        peer, skip, version = _peer_config(bench)
        if peer is not None:
            configs.insert(0, peer)
        elif bench.peer is not None:
            say(f"peer row skipped: {skip}; running the usp rows only.", flush=True)
        rows = _measure_rows(bench, configs, (q, k, v, dout), say)
    if rank != 0:
        dist.barrier()  # leave together: a rank tearing gloo down early can abort its peers
        return None
    result = results(bench, rows, skip, version)
    if result_path is not None:
        Path(result_path).write_text(json.dumps(result))
    dist.barrier()
    return result


def _measure_rows(bench: AttentionBench, configs, tensors, say) -> list[Row]:
    """Check every config against the first, then time them round-robin."""
    # per config: its own shards of q, k, v and of the output gradient
    prepared = [(row, [shard(t) for t in tensors[:3]], shard(tensors[3]).detach(), call, gather,
                 comm) for row, shard, call, gather, comm in configs]

    def step(inputs, dout_l, call, row=None, comm=None):
        for t in inputs:
            t.grad = None
        if comm is not None:
            seen = comm.exposed_s["ulysses"], comm.hidden_s["ulysses"]
        cpu0 = time.process_time()
        out = call(*inputs)
        out.backward(dout_l)
        if row is not None:
            row.cpu_ms.append((time.process_time() - cpu0) * 1e3)
        if comm is not None:  # this call's ulysses time, waited for and hidden
            row.a2a_exposed_ms.append((comm.exposed_s["ulysses"] - seen[0]) * 1e3)
            row.a2a_hidden_ms.append((comm.hidden_s["ulysses"] - seen[1]) * 1e3)
        return out

    # correctness: every row's output and dq, dk, dv (gathered) against the first row's
    ref = None
    for row, inputs, dout_l, call, gather, _ in prepared:
        out = step(inputs, dout_l, call).detach()
        full = [gather(t).double() for t in (out, *(x.grad for x in inputs))]
        ref = full if ref is None else ref
        row.max_abs_diff = max((a - b).abs().max().item() for a, b in zip(full, ref))

    say(f"{len(prepared)} configs x (warmup {bench.warmup} + iters {bench.iters}), "
        f"{dist.get_world_size()} processes x {torch.get_num_threads()} threads", flush=True)

    def progress(it: int) -> None:
        if it >= 0:
            say(f"  iter {it + 1}/{bench.iters} done", flush=True)

    fns = [partial(step, inputs, dout_l, call, row, comm)
           for row, inputs, dout_l, call, _, comm in prepared]
    per_round = round_robin(fns, bench.iters, bench.warmup, on_round=progress)  # [iters][rows]
    for j, (row, *_rest) in enumerate(prepared):
        row.times_ms = [r[j] * 1e3 for r in per_round]
    timed = [row for row, *_rest in prepared if row.a2a_exposed_ms]
    spans = mean_over_ranks([[row.a2a_exposed_ms[-bench.iters:], row.a2a_hidden_ms[-bench.iters:]]
                             for row in timed])  # the timed rounds': [rows][2][iters]
    for row, (exposed, hidden) in zip(timed, spans):
        row.a2a_exposed_ms, row.a2a_hidden_ms = exposed, hidden
    cpu = mean_over_ranks([row.cpu_ms[-bench.iters:] for row, *_rest in prepared])
    for (row, *_rest), ms in zip(prepared, cpu):
        row.cpu_ms = ms
    return [p[0] for p in prepared]


def launched_world() -> int | None:
    """The world size when this process is a rank of a torchrun/Slurm launch, else None."""
    info = launcher_env()
    return None if info is None else info["world"]


def measure(bench: AttentionBench) -> dict | None:
    """Run the benchmark and return ``run_rank``'s result (None on ranks other than 0).

    Started plainly, it spawns ``bench.nprocs`` local gloo processes. Under torchrun
    (``launcher_env()`` set) this process is one rank of that group, whose size must be
    ``bench.nprocs``.
    """
    info = launcher_env()
    if info is None:
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "result.json")
            spawn_local(run_rank, bench.nprocs, bench, path, threads=bench.threads)
            return json.loads(Path(path).read_text())
    if info["world"] != bench.nprocs:
        raise ValueError(f"this launch has {info['world']} ranks but nprocs={bench.nprocs}; "
                         f"pass nprocs={info['world']}")
    torch.set_num_threads(bench.threads)
    init_from_env(info, "cpu")
    try:
        return run_rank(bench)
    finally:
        dist.destroy_process_group()


# ---- the command ---------------------------------------------------------------------

FULL = {f.name: f.default for f in fields(AttentionBench) if f.name in QUICK}


def parse_args(argv=None, peer=None) -> tuple[AttentionBench, Path | None]:
    """The command line -> (settings, JSON path); ``peer`` as ``AttentionBench.peer``
    (``--no-peer`` drops it)."""
    p = argparse.ArgumentParser(description="Forward+backward time of one attention call, "
                                            "usp layouts side by side.")
    p.add_argument("--nprocs", type=int, default=4,
                   help="local gloo processes (= sp size); under torchrun: its world size")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=None,
                   help=f"global L (default {FULL['seq_len']})")
    p.add_argument("--heads", type=int, default=8, help="query heads")
    p.add_argument("--kv-heads", type=int, default=None, help="KV heads (default: --heads)")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--layouts", default=None,
                   help="usp layouts, ULYSSESxRING, comma-separated (default: every u x r = "
                        "nprocs the head counts allow, ulysses first; 4x1,2x2,1x4 for 4)")
    p.add_argument("--balance", choices=("zigzag", "contiguous"), default="zigzag")
    p.add_argument("--warmup", type=int, default=None,
                   help=f"untimed rounds (default {FULL['warmup']})")
    p.add_argument("--iters", type=int, default=None,
                   help=f"timed rounds (default {FULL['iters']})")
    p.add_argument("--threads", type=int, default=None,
                   help="intra-op threads per process (default: CPUs // nprocs, >= 1)")
    if peer is not None:
        p.add_argument("--no-peer", action="store_true", help="usp rows only")
    p.add_argument("--a2a-chunks", default="1",
                   help="pipeline stages of the ulysses all-to-alls, comma-separated: a usp "
                        "row per count for each layout with ulysses > 1 (default 1); auto: "
                        "no count given (usp_attention's default from the mesh)")
    p.add_argument("--pieces", default="auto",
                   help="how ulysses and ring messages travel, comma-separated, a row each: "
                        "auto (the mesh's default: pieces where an axis's groups cross hosts "
                        "over gloo) and/or whole (never cut)")
    p.add_argument("--quick", action="store_true",
                   help=f"smoke-test size: L={QUICK['seq_len']}, warmup {QUICK['warmup']}, "
                        f"iters {QUICK['iters']} (explicit flags still win)")
    p.add_argument("--json", type=Path, default=None, help="write results here")
    args = p.parse_args(argv)
    preset = QUICK if args.quick else FULL
    sizes = {key: val if getattr(args, key) is None else getattr(args, key)
             for key, val in preset.items()}
    try:  # refuse before any process starts
        try:
            chunks = tuple(c if c == "auto" else int(c) for c in args.a2a_chunks.split(","))
        except ValueError:
            raise ValueError(f"bad --a2a-chunks {args.a2a_chunks!r}: write counts like 1,2,4 "
                             f"or auto") from None
        bench = AttentionBench(
            nprocs=launched_world() or args.nprocs, batch=args.batch, heads=args.heads,
            kv_heads=args.kv_heads, head_dim=args.head_dim, causal=args.causal,
            dtype=args.dtype, balance=args.balance, threads=args.threads,
            layouts=parse_layouts(args.layouts) if args.layouts else None,
            peer=None if peer is None or args.no_peer else peer, a2a_chunks=chunks,
            pieces=tuple(args.pieces.split(",")), **sizes)
    except ValueError as e:
        p.error(str(e))
    return bench, args.json


def main(argv=None, peer=None) -> None:
    bench, json_path = parse_args(argv, peer)
    result = measure(bench)
    if result is None:  # a rank other than 0 of a torchrun launch
        return
    print(format_report(result))
    if json_path:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(result, indent=2))
        print(f"wrote {json_path}")


if __name__ == "__main__":
    main()
