"""Forward+backward time of one attention call: usp layouts side by side (and a peer's row).

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

import json
import os
import tempfile
import time
from contextlib import ExitStack
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from ..attention import usp_attention
from ..config.checks import at_least, one_of
from ..launch import init_from_env, launcher_env, spawn_local
from ..layout import SequenceLayout
from ..mesh import SPMesh
from ..ulysses import check_a2a_chunks
from ..validate import check_degrees, check_heads, check_seq_len
from .attention_report import results
from .timing import default_threads, mean_over_ranks, round_robin

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
          "fp64": torch.float64}
QUICK = dict(seq_len=1024, warmup=1, iters=3)  # the smoke-test size


def parse_layouts(text: str) -> tuple[tuple[int, int], ...]:
    """``"4x1,2x2"`` -> ((4, 1), (2, 2)): ULYSSESxRING, comma-separated."""
    out = []
    for item in text.split(","):
        try:
            u, r = (int(x) for x in item.lower().split("x"))
        except ValueError:
            raise ValueError(f"bad layout {item!r}: write ULYSSESxRING, e.g. 4x1,2x2,1x4") from None
        out.append((u, r))
    return tuple(out)


def default_layouts(nprocs: int, heads: int, kv_heads: int) -> tuple[tuple[int, int], ...]:
    """Every (ulysses, ring) with u * r = nprocs whose ulysses degree the heads allow,
    ulysses first: (4, 1), (2, 2), (1, 4) for 4."""
    out = []
    for u in range(nprocs, 0, -1):
        if nprocs % u == 0:
            try:
                check_heads(heads, kv_heads, u)
            except ValueError:
                continue
            out.append((u, nprocs // u))
    return tuple(out)


@dataclass
class AttentionBench:
    """What to time: one attention call [B, L, Hq|Hkv, d] on ``nprocs`` ranks.

    ``kv_heads``, ``layouts`` and ``threads`` default (None) to ``heads``,
    ``default_layouts`` and ``default_threads``. Every layout must use all ``nprocs``
    ranks (one sequence-parallel group). Bad values raise ``ValueError`` here, before any
    process starts.
    """

    nprocs: int = 4
    batch: int = 1
    seq_len: int = 8192
    heads: int = 8
    kv_heads: int | None = None
    head_dim: int = 64
    causal: bool = True
    dtype: str = "fp32"  # a key of DTYPES
    layouts: tuple[tuple[int, int], ...] | None = None
    balance: str = "zigzag"
    warmup: int = 1
    iters: int = 5
    threads: int | None = None
    # peer(bench) -> (row config or None, skip reason or None, version or None), run by
    # every rank (collective): another implementation's row, first in the table
    peer: Callable | None = None
    a2a_chunks: tuple[int, ...] = (1,)  # a usp row per count for layouts with ulysses > 1

    def __post_init__(self) -> None:
        at_least("bench", 1, nprocs=self.nprocs, batch=self.batch, heads=self.heads,
                 head_dim=self.head_dim, iters=self.iters)
        at_least("bench", 0, warmup=self.warmup)
        one_of("bench.dtype", self.dtype, tuple(DTYPES))
        if self.kv_heads is None:
            self.kv_heads = self.heads
        if self.threads is None:
            self.threads = default_threads(self.nprocs)
        at_least("bench", 1, kv_heads=self.kv_heads, threads=self.threads)
        if self.layouts is None:
            self.layouts = default_layouts(self.nprocs, self.heads, self.kv_heads)
        self.layouts = tuple((int(u), int(r)) for u, r in self.layouts)
        for u, r in self.layouts:
            if check_degrees(self.nprocs, u, r) != 1:
                raise ValueError(
                    f"layout {u}x{r} uses {u * r} of {self.nprocs} processes; the benchmark "
                    f"times one sequence-parallel group, so pick ulysses x ring = {self.nprocs}")
            check_heads(self.heads, self.kv_heads, u)
            check_seq_len(self.seq_len, u, r, self.balance)
            for c in self.a2a_chunks if u > 1 else ():
                check_a2a_chunks(c, self.heads, self.kv_heads, u)
        if not self.a2a_chunks:
            raise ValueError("bench.a2a_chunks is empty; pass at least one count, e.g. 1")

    def usp_rows(self) -> list[tuple[int, int, int]]:
        """(ulysses, ring, a2a_chunks) per usp row; ulysses 1 layouts: one row."""
        return [(u, r, c) for u, r in self.layouts
                for c in (self.a2a_chunks if u > 1 else self.a2a_chunks[:1])]


@dataclass
class Row:
    name: str
    kind: str  # "usp" | "peer"
    ulysses: int
    ring: int
    times_ms: list[float] = field(default_factory=list)
    max_abs_diff: float = float("nan")  # out, dq, dk, dv vs the first row's
    a2a_chunks: int = 1
    a2a_exposed_ms: list[float] = field(default_factory=list)  # per timed round
    a2a_hidden_ms: list[float] = field(default_factory=list)
    cpu_ms: list[float] = field(default_factory=list)  # process CPU per call, all its threads

    def stats(self) -> dict:
        t = torch.tensor(self.times_ms, dtype=torch.float64)
        std = t.std().item() if len(t) > 1 else 0.0
        out = dict(mean_ms=t.mean().item(), std_ms=std, min_ms=t.min().item(),
                   median_ms=t.median().item())
        exp, hid = (sum(x) / len(x) if x else None
                    for x in (self.a2a_exposed_ms, self.a2a_hidden_ms))
        cpu = sum(self.cpu_ms) / len(self.cpu_ms) if self.cpu_ms else None
        return dict(out, a2a_exposed_mean_ms=exp, a2a_hidden_mean_ms=hid,
                    a2a_exposed_share=None if exp is None else exp / out["mean_ms"],
                    cpu_mean_ms=cpu)


# ---- one rank -----------------------------------------------------------------------------


def make_usp(bench: AttentionBench, mesh: SPMesh, chunks: int = 1):
    """(row, shard, call, gather, comm stats) of ``usp_attention`` on ``mesh`` with
    ``a2a_chunks=chunks``."""
    layout = SequenceLayout(mesh, seq_len=bench.seq_len, balance=bench.balance)

    def shard(x):  # [B, L, H, d] -> this rank's [B, L/P, H, d]
        return layout.shard(x, dim=1).detach().clone().requires_grad_(True)

    def call(ql, kl, vl):
        return usp_attention(ql, kl, vl, mesh=mesh, layout=layout, causal=bench.causal,
                             kernel="torch", a2a_chunks=chunks)

    def gather(out):  # [B, L/P, H, d] -> [B, L, H, d]
        return layout.gather(out, dim=1)

    u, r = mesh.ulysses, mesh.ring
    name = f"usp u={u} r={r}" + (f" c{chunks}" if chunks > 1 else "")
    return Row(name, "usp", u, r, a2a_chunks=chunks), shard, call, gather, mesh.comm


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
    ``paired_median`` (the median of per-round ratios), or None. None on other ranks.
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
        built = {(u, r): meshes.enter_context(SPMesh.build(ulysses=u, ring=r))
                 for u, r in bench.layouts}
        configs = [make_usp(bench, built[u, r], c) for u, r, c in bench.usp_rows()]
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
