"""Calibrate the planner's cost model against this machine and against published figures.

1. Measures this machine on N local gloo processes (``usp.bench.calibrate.measure``):
   all-to-all and ring-step links, the LSE merge, how much of a ring transfer hides
   behind a kernel call, the attention kernel's rate, and ``usp_attention``
   forward+backward for several (ulysses, ring) layouts and lengths, each beside its
   compute-only replay.
2. Fits the cost model's fields to it and predicts the same calls
   (``usp.planner.calibration.format_report``): measured vs predicted, and whether the
   model orders the layouts as measured; prints the ``configs/cluster/cpu_local.yaml``
   lines.
3. Sets the model beside benchmark figures published by ring-flash-attn and USP
   (``usp.planner.published``).

    python tools/calibrate_planner.py                  # about 90 s on a 2-core box
    python tools/calibrate_planner.py --quick          # smoke test, about 30 s
    python tools/calibrate_planner.py --published-only # the published comparison, no processes
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from usp.bench.calibrate import measure
from usp.planner.calibration import FULL, QUICK, STATS, CalibrationSetup, format_report
from usp.planner.published import SOURCES, format_published, published_rows


def _ints(text: str, sep: str = ",") -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(sep))
    except ValueError:
        raise ValueError(f"{text!r} is not integers separated by {sep!r}") from None


def parse_args(argv=None) -> tuple[argparse.Namespace, CalibrationSetup]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
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
