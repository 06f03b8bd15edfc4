"""Peak memory per rank of one training step against L/P, with and without each memory
feature; the longest L/P under a budget; weak scaling; planner against measured.

    python -m tools.bench_memory --quick          # < 60 s: two lengths, no weak scaling
    python -m tools.bench_memory                  # the full run (docs/memory.md)
    python -m tools.bench_memory --plot docs/memory.png

What is measured and how: ``tools.lab.memory`` (the tracker, the trainer's own step) and
``tools.lab.memory_sweep`` (the plan). The last line is
``max_seq_len_per_rank baseline=<int> optimized=<int> ratio=<float>``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tools.lab.memory_report import plot, report
from tools.lab.memory_sweep import MemoryBench, Sweep, bracket, load, run, save

QUICK = dict(lengths=(128, 1024), budget_mib=52.0, resolution=1024, cap_mib=52.0,
             time_per_rank=64, vocab_size=8000, features=("baseline", "optimized"), weak=False)
FULL = dict(lengths=MemoryBench.lengths, budget_mib=MemoryBench.budget_mib,
            resolution=MemoryBench.resolution, cap_mib=MemoryBench.cap_mib,
            time_per_rank=MemoryBench.time_per_rank, vocab_size=MemoryBench.vocab_size,
            features=MemoryBench.features, weak=True)


def parse_args(argv=None) -> tuple[MemoryBench, bool, argparse.Namespace]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help=f"smoke-test size {QUICK}")
    p.add_argument("--lengths", default=None, help="tokens per rank, comma separated")
    p.add_argument("--budget-mib", type=float, default=None)
    p.add_argument("--resolution", type=int, default=None, help="bisection step (tokens per rank)")
    p.add_argument("--no-weak", action="store_true", help="skip the weak-scaling runs")
    p.add_argument("--weak-only", action="store_true", help="only the weak-scaling runs")
    p.add_argument("--weak-per-rank", type=int, default=None,
                   help=f"tokens per rank of the weak-scaling runs (default "
                        f"{MemoryBench.weak_per_rank})")
    p.add_argument("--threads", type=int, default=None, help="intra-op threads per rank")
    p.add_argument("--plot", type=Path, default=None, help="write the curves to this PNG")
    p.add_argument("--save", type=Path, default=None, help="write the points to this JSON")
    p.add_argument("--load", type=Path, nargs="+", default=None,
                   help="report the points of --save files (same flags) instead of measuring")
    args = p.parse_args(argv)
    preset = dict(QUICK if args.quick else FULL)
    weak = preset.pop("weak") and not args.no_weak
    if args.lengths:
        preset["lengths"] = tuple(int(x) for x in args.lengths.split(","))
    if args.budget_mib is not None:
        preset["budget_mib"] = args.budget_mib
    if args.resolution is not None:
        preset["resolution"] = args.resolution
    if args.weak_per_rank is not None:
        preset["weak_per_rank"] = args.weak_per_rank
    try:
        return MemoryBench(**preset, threads=args.threads), weak, args
    except ValueError as e:  # refuse before any process starts
        p.error(str(e))


def main(argv=None) -> int:
    bench, weak, args = parse_args(argv)
    if args.load:  # the longest fits again, for this budget, from the measured lengths only
        sweep = Sweep()
        for path in args.load:  # a point measured twice (same layout, length) counts once
            sweep.points += [p for p in load(path).points if sweep.find(
                p.features, p.per_rank, p.ulysses * p.ring, p.timed) is None]
        for name in ("baseline", "optimized"):
            peaks = {p.per_rank: p.memory.peak for p in sweep.points if p.features == name
                     and not p.timed and p.ulysses * p.ring == bench.world}
            if peaks:
                sweep.longest[name] = bracket(peaks, bench.budget_mib * 2**20)
    else:
        sweep = run(bench, weak=weak or args.weak_only, main=not args.weak_only)
    if args.save:
        save(sweep, args.save)
    if args.plot:
        plot(bench, sweep, args.plot)
    lines = report(bench, sweep)
    print("\n".join(lines))
    return 0 if lines[-1].startswith("max_seq_len_per_rank ") else 1  # 1: a fit had no bracket


if __name__ == "__main__":
    sys.exit(main())
