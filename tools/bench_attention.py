"""Forward+backward time of one attention call: usp layouts side by side with DeepSpeed-Ulysses.

Runs N local CPU processes on gloo. Every measured config lives in the same processes and
the configs are interleaved round-robin over the iterations (the starting config rotates
each iteration), so machine noise lands on all of them alike. One measurement is

    barrier -> t0 -> out = attn(q, k, v); out.backward(dout) -> t1 -> barrier

and the iteration's time is the max of ``t1 - t0`` over ranks (the slowest rank sets the
pace of a synchronous step). Rows:

- ``usp u=X r=Y``: ``usp_attention`` on ``SPMesh.build(ulysses=X, ring=Y)``;
- ``deepspeed u=N``: ``deepspeed.sequence.layer.DistributedAttention`` over all N ranks
  (pure Ulysses), optional: skipped with a message when DeepSpeed is not importable.

Both call the same local kernel, ``usp.kernels.local_attention(..., kernel="torch")``
(the aten CPU flash op with LSE). Inputs are one global [B, L, H, d] tensor drawn from a
fixed seed; each config shards it its own way (usp: ``SequenceLayout.shard``; DeepSpeed:
contiguous L/N slices). Before timing, every row's gathered output is compared with the
first row's, and so are the input gradients, so a fast but wrong config cannot hide in
the table (column ``max|diff|``). ``vs DS`` is mean / DeepSpeed's mean; on a busy machine
with few iterations the mean swings, so the summary line also gives the ratio of medians,
of minima, and the median of per-round ratios (both rows run in every round).

Threads: every process uses ``--threads`` intra-op threads (default: the CPUs this
process may run on divided by N, at least 1), the same for all configs. With N=4 on a
2-core machine that is 1 thread per process, i.e. 2x oversubscription, which stays
equal across configs because they all run in the same processes.

    python tools/bench_attention.py                       # the issue's default shapes
    python tools/bench_attention.py --quick               # small, for a smoke test
    python tools/bench_attention.py --layouts 4x1,2x2 --kv-heads 4 --json out.json
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from usp import SPMesh, SequenceLayout, usp_attention  # noqa: E402
from usp.kernels import local_attention  # noqa: E402
from usp.launch import init_from_env, launcher_env, spawn_local  # noqa: E402
from usp.validate import check_degrees, check_heads, seq_multiple  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
          "fp64": torch.float64}
FULL = dict(seq_len=8192, warmup=1, iters=5)
QUICK = dict(seq_len=1024, warmup=1, iters=3)


@dataclass
class Row:
    name: str
    kind: str  # "usp" | "deepspeed"
    ulysses: int
    ring: int
    times_ms: list[float] = field(default_factory=list)
    max_abs_diff: float = float("nan")  # out, dq, dk, dv vs the first row's

    def stats(self) -> dict:
        t = torch.tensor(self.times_ms, dtype=torch.float64)
        std = t.std().item() if len(t) > 1 else 0.0
        return dict(mean_ms=t.mean().item(), std_ms=std, min_ms=t.min().item(),
                    median_ms=t.median().item())


# ---- arguments ------------------------------------------------------------------------


def parse_layouts(text: str) -> list[tuple[int, int]]:
    out = []
    for item in text.split(","):
        try:
            u, r = (int(x) for x in item.lower().split("x"))
        except ValueError:
            raise ValueError(f"bad layout {item!r}: write ULYSSESxRING, e.g. 4x1,2x2,1x4") from None
        out.append((u, r))
    return out


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nprocs", type=int, default=4, help="local gloo processes (= sp size)")
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
    p.add_argument("--no-deepspeed", action="store_true", help="usp rows only")
    p.add_argument("--quick", action="store_true",
                   help=f"smoke-test size: L={QUICK['seq_len']}, warmup {QUICK['warmup']}, "
                        f"iters {QUICK['iters']} (explicit flags still win)")
    p.add_argument("--json", type=Path, default=None, help="write results here")
    args = p.parse_args(argv)
    preset = QUICK if args.quick else FULL
    for key, val in preset.items():
        if getattr(args, key) is None:
            setattr(args, key, val)
    if args.kv_heads is None:
        args.kv_heads = args.heads
    if args.threads is None:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        args.threads = max(1, (cpus or 1) // args.nprocs)
    try:
        args.layouts = parse_layouts(args.layouts) if args.layouts else default_layouts(args)
        validate(args)
    except ValueError as e:  # refuse before any process starts
        p.error(str(e))
    return args


def default_layouts(args: argparse.Namespace) -> list[tuple[int, int]]:
    """Every (ulysses, ring) with u * r = nprocs whose ulysses degree the heads allow."""
    out = []
    for u in range(args.nprocs, 0, -1):
        if args.nprocs % u == 0:
            try:
                check_heads(args.heads, args.kv_heads, u)
            except ValueError:
                continue
            out.append((u, args.nprocs // u))
    return out


def validate(args: argparse.Namespace) -> None:
    """Refuse impossible shapes before any process starts (usp's own rules, then ours)."""
    if args.iters < 1 or args.warmup < 0:
        raise ValueError(f"need iters >= 1 and warmup >= 0, got {args.iters} and {args.warmup}")
    for u, r in args.layouts:
        if check_degrees(args.nprocs, u, r) != 1:
            raise ValueError(
                f"layout {u}x{r} uses {u * r} of {args.nprocs} processes; the benchmark times "
                f"one sequence-parallel group, so pick ulysses x ring = {args.nprocs}"
            )
        check_heads(args.heads, args.kv_heads, u)
        m = seq_multiple(u, r, args.balance)
        if args.seq_len % m:
            raise ValueError(
                f"seq_len {args.seq_len} is not a multiple of {m} (layout {u}x{r}, "
                f"balance={args.balance}); use e.g. {math.ceil(args.seq_len / m) * m}"
            )


def deepspeed_skip_reason(args: argparse.Namespace) -> str | None:
    """Why the DeepSpeed row cannot run on these shapes (None when it can)."""
    n = args.nprocs
    if args.no_deepspeed:
        return "--no-deepspeed given"
    if args.heads % n or args.kv_heads % n:
        return (f"DeepSpeed-Ulysses needs heads ({args.heads}) and KV heads ({args.kv_heads}) "
                f"divisible by its degree {n}")
    if args.seq_len % n:
        return f"seq_len {args.seq_len} is not divisible by {n}"
    return None


# ---- DeepSpeed (optional) ---------------------------------------------------------------


def import_deepspeed():
    """Return DistributedAttention, or the reason it is unavailable (a string).

    DeepSpeed's comm backend builds a C++ shared-memory op on CPU when it starts; we only
    need its gloo all-to-all, so ``build_shm_op`` is replaced by a no-op first.
    """
    # this benchmark is CPU/gloo only: name the accelerator instead of letting DeepSpeed
    # probe for one (and warn on every rank)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        ds_comm_torch = importlib.import_module("deepspeed.comm.torch")
        ds_comm_torch.build_shm_op = lambda: None
        import deepspeed.comm as ds_dist
        from deepspeed.sequence.layer import DistributedAttention
        from deepspeed.utils import logger as ds_logger

        ds_logger.setLevel("WARNING")
        # the torch process group exists already: DeepSpeed only wraps it
        ds_dist.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)
    except Exception as e:  # ImportError, or a broken install
        return f"DeepSpeed is not usable ({type(e).__name__}: {e})"
    return DistributedAttention


# ---- one rank -----------------------------------------------------------------------------


def make_usp(args, u, r):
    mesh = SPMesh.build(ulysses=u, ring=r)
    layout = SequenceLayout(mesh, seq_len=args.seq_len, balance=args.balance)

    def shard(x):  # [B, L, H, d] -> this rank's [B, L/P, H, d]
        return layout.shard(x, dim=1).detach().clone().requires_grad_(True)

    def call(ql, kl, vl):
        return usp_attention(ql, kl, vl, mesh=mesh, layout=layout, causal=args.causal,
                             kernel="torch")

    def gather(out):  # [B, L/P, H, d] -> [B, L, H, d]
        return layout.gather(out, dim=1)

    return Row(f"usp u={u} r={r}", "usp", u, r), shard, call, gather


def make_deepspeed(args, DistributedAttention):
    n, rank = dist.get_world_size(), dist.get_rank()
    # [B, L, H, d] with batch first: scatter heads (dim 2), gather sequence (dim 1);
    # forward(..., batch_dim_idx=0). DeepSpeed's defaults (2, 0) are for [L, B, H, d].
    attn = DistributedAttention(
        partial(local_attention, causal=args.causal, kernel="torch"),
        dist.group.WORLD, scatter_idx=2, gather_idx=1,
    )
    span = args.seq_len // n

    def shard(x):  # [B, L, H, d] -> contiguous [B, L/N, H, d]
        return x[:, rank * span:(rank + 1) * span].detach().clone().requires_grad_(True)

    def call(ql, kl, vl):
        return attn(ql, kl, vl, 0)

    def gather(out):  # [B, L/N, H, d] -> [B, L, H, d]
        parts = [torch.empty_like(out) for _ in range(n)]
        dist.all_gather(parts, out.contiguous())
        return torch.cat(parts, dim=1)

    return Row(f"deepspeed u={n}", "deepspeed", n, 1), shard, call, gather


def run_rank(args: argparse.Namespace) -> None:
    rank, n = dist.get_rank(), dist.get_world_size()
    say = print if rank == 0 else (lambda *a, **k: None)
    dtype = DTYPES[args.dtype]

    # one global problem, identical on every rank (fixed seed)
    g = torch.Generator().manual_seed(0)
    shape_q = (args.batch, args.seq_len, args.heads, args.head_dim)
    shape_kv = (args.batch, args.seq_len, args.kv_heads, args.head_dim)
    q = torch.randn(shape_q, generator=g).to(dtype)
    k = torch.randn(shape_kv, generator=g).to(dtype)
    v = torch.randn(shape_kv, generator=g).to(dtype)
    dout = torch.randn(shape_q, generator=g).to(dtype)

    configs = [make_usp(args, u, r) for u, r in args.layouts]
    skip = deepspeed_skip_reason(args)
    if skip is None:
        DistributedAttention = import_deepspeed()
        ok = torch.tensor([0 if isinstance(DistributedAttention, str) else 1])
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)  # every rank must agree to run the row
        if ok.item():
            configs.insert(0, make_deepspeed(args, DistributedAttention))
        else:
            skip = DistributedAttention if isinstance(DistributedAttention, str) else \
                "DeepSpeed failed to import on another rank"
    if skip is not None:
        say(f"DeepSpeed row skipped: {skip}; running the usp rows only.", flush=True)

    # per config: its own shards of q, k, v and of the output gradient
    prepared = []
    for row, shard, call, gather in configs:
        prepared.append((row, [shard(t) for t in (q, k, v)], shard(dout).detach(), call, gather))

    def step(inputs, dout_l, call):
        for t in inputs:
            t.grad = None
        out = call(*inputs)
        out.backward(dout_l)
        return out

    # correctness: every row's output and dq, dk, dv (gathered) against the first row's
    ref = None
    for row, inputs, dout_l, call, gather in prepared:
        out = step(inputs, dout_l, call).detach()
        full = [gather(t).double() for t in (out, *(x.grad for x in inputs))]
        ref = full if ref is None else ref
        row.max_abs_diff = max((a - b).abs().max().item() for a, b in zip(full, ref))

    say(f"{len(prepared)} configs x (warmup {args.warmup} + iters {args.iters}), "
        f"{n} processes x {torch.get_num_threads()} threads", flush=True)
    times = torch.zeros(args.iters, len(prepared), dtype=torch.float64)
    for it in range(-args.warmup, args.iters):
        start = it % len(prepared)
        for j in list(range(start, len(prepared))) + list(range(start)):  # round-robin
            _, inputs, dout_l, call, _ = prepared[j]
            dist.barrier()
            t0 = time.perf_counter()
            step(inputs, dout_l, call)
            t1 = time.perf_counter()
            dist.barrier()
            if it >= 0:
                times[it, j] = (t1 - t0) * 1e3
        if it >= 0:
            say(f"  iter {it + 1}/{args.iters} done", flush=True)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)  # per iteration: the slowest rank
    for j, (row, *_rest) in enumerate(prepared):
        row.times_ms = times[:, j].tolist()

    if rank == 0:
        report(args, [p[0] for p in prepared], skip)
    dist.barrier()  # leave together: a rank tearing gloo down early can abort its peers


# ---- output -----------------------------------------------------------------------------


def report(args: argparse.Namespace, rows: list[Row], skip: str | None) -> None:
    ds = next((r for r in rows if r.kind == "deepspeed"), None)
    ds_mean = ds.stats()["mean_ms"] if ds else None
    print()
    print(f"attention fwd+bwd: B={args.batch} L={args.seq_len} Hq={args.heads} "
          f"Hkv={args.kv_heads} d={args.head_dim} causal={args.causal} dtype={args.dtype} "
          f"balance={args.balance} nprocs={args.nprocs} threads/proc={args.threads} "
          f"iters={args.iters} (max over ranks per iteration)")
    head = (f"{'config':<18} {'mean ms':>10} {'std ms':>9} {'min ms':>10} {'median ms':>10} "
            f"{'vs DS':>7} {'max|diff|':>10}")
    print(head)
    print("-" * len(head))
    results = []
    for row in rows:
        s = row.stats()
        ratio = s["mean_ms"] / ds_mean if ds_mean else None
        rtxt = f"{ratio:7.3f}" if ratio is not None else f"{'-':>7}"
        print(f"{row.name:<18} {s['mean_ms']:10.1f} {s['std_ms']:9.1f} {s['min_ms']:10.1f} "
              f"{s['median_ms']:10.1f} {rtxt} {row.max_abs_diff:10.2e}")
        results.append({**asdict(row), **s, "ratio_to_deepspeed": ratio})
    n = args.nprocs
    pure = next((r for r in rows if r.kind == "usp" and r.ulysses == n and r.ring == 1), None)
    headline = paired = None
    if ds and pure:
        p, d = pure.stats(), ds.stats()
        headline = p["mean_ms"] / d["mean_ms"]
        # both run in every round: the median of per-round ratios cancels load that
        # drifts from round to round
        paired = (torch.tensor(pure.times_ms) / torch.tensor(ds.times_ms)).median().item()
        print(f"\nusp(u={n}) / DeepSpeed(u={n}) = {headline:.3f} (mean); "
              f"{p['median_ms'] / d['median_ms']:.3f} (median); "
              f"{p['min_ms'] / d['min_ms']:.3f} (min); {paired:.3f} (median of per-round ratios)")
    elif not ds:
        print(f"\nno DeepSpeed row ({skip}); no ratio")
    if args.json:
        meta = {k: (v if k != "json" else str(v)) for k, v in vars(args).items()}
        meta["layouts"] = [f"{u}x{r}" for u, r in args.layouts]
        env = dict(torch=torch.__version__, python=platform.python_version(),
                   cpus=os.cpu_count(), threads_per_proc=args.threads)
        if ds:
            env["deepspeed"] = importlib.import_module("deepspeed").__version__
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(dict(args=meta, env=env, rows=results,
                                             usp_over_deepspeed=headline,
                                             usp_over_deepspeed_paired_median=paired), indent=2))
        print(f"wrote {args.json}")


def main(argv=None) -> None:
    info = launcher_env()
    if info is None:
        args = parse_args(argv)
        spawn_local(run_rank, args.nprocs, args, threads=args.threads)
        return
    # under torchrun (e.g. through tools/simcluster.py): this process is one rank
    args = parse_args([*(argv if argv is not None else sys.argv[1:]),
                       "--nprocs", str(info["world"])])
    torch.set_num_threads(args.threads)
    init_from_env(info, "cpu")
    try:
        run_rank(args)
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
