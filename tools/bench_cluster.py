"""usp on a simulated 2-node x 2-rank cluster: the multi-node benchmarks (needs root).

Measures links, attention placement (a), degrees (b), ring efficiency (c), saved
activations (d) and bytes per layer (e), plus ``usp-train`` steps next to the planner's
ranking (``tools.lab.cluster``); with ``--a2a-chunks`` also (f), the pipelined all-to-all
where it crosses nodes (2 x 2 and 2 x 1 clusters), against the planner's predicted gain
and choice, and the usp-train step's attention-communication share. Tables are
printed and written to ``OUT/tables.txt``, everything to ``OUT/results.json``, a PNG per
benchmark to OUT.

    python -m tools.bench_cluster               # rate auto (loopback / 9), out runs/bench_cluster
    python -m tools.bench_cluster --rate 300mbit --intra-rate 2700mbit --out runs/bench_cluster/r300m
    python -m tools.bench_cluster --placement-sweep 1gbit:9gbit,200mbit:1800mbit
    python -m tools.bench_cluster --rate 300mbit --intra-rate 2700mbit --queue-ms 30 \\
        --a2a-chunks 1,2,auto --only-chunks --out runs/bench_cluster/chunks
    python -m tools.bench_cluster --report-only --out runs/bench_cluster/r300m
    python -m tools.bench_cluster --rate 300mbit --intra-rate 2700mbit --queue-ms 30 \
        --only-ring --ring-seq-len 2048,4096 --ring-iters 21 --out runs/bench_cluster/ring
"""

from __future__ import annotations

import argparse
import signal
import sys

from tools.lab.cluster import ClusterBench, placement_sweep, report_saved, ring_only, run
from tools.lab.simcluster import SimClusterError, interrupt_on_signal, preflight


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    d = ClusterBench()
    ap.add_argument("--out", default=d.out)
    ap.add_argument("--rate", default=d.rate, help="inter-node rate, tc units or 'auto'")
    ap.add_argument("--ratio", type=float, default=d.ratio, help="loopback / inter for auto")
    ap.add_argument("--intra-rate", default=d.intra_rate, help="shape loopback too")
    ap.add_argument("--queue-ms", type=float, default=d.queue_ms,
                    help="tbf queue of each shaped link, ms (30 avoids the slowdown of large "
                         "two-way exchanges that 100 causes; see tools.lab.simcluster)")
    ap.add_argument("--seq-len", type=int, default=d.seq_len, help="attention benchmarks")
    ap.add_argument("--heads", type=int, default=d.heads)
    ap.add_argument("--kv-heads", type=int, default=d.kv_heads, help="GQA like the tiny model")
    ap.add_argument("--head-dim", type=int, default=d.head_dim)
    ap.add_argument("--iters", type=int, default=d.iters)
    ap.add_argument("--warmup", type=int, default=d.warmup)
    ap.add_argument("--mem-seq-len", type=int, default=d.mem_seq_len)
    ap.add_argument("--train-seq-len", type=int, default=d.train_seq_len)
    ap.add_argument("--train-batch", type=int, default=d.train_batch)
    ap.add_argument("--train-steps", type=int, default=d.train_steps)
    ap.add_argument("--train-passes", type=int, default=d.train_passes,
                    help="usp-train runs per config, in alternating order; best median wins")
    ap.add_argument("--ring-seq-len", default=",".join(map(str, d.ring_seq_lens)),
                    help="(c) on 2 nodes x 1 rank (one process per core): lengths, comma-separated")
    ap.add_argument("--ring-iters", type=int, default=d.ring_iters)
    ap.add_argument("--link-bytes", type=int, default=d.link_bytes)
    ap.add_argument("--a2a-chunks", default="",
                    help="(f) pipelined all-to-all across nodes: usp-train a2a_chunks, e.g. "
                         "'1,2,auto' (auto: the planner's count); attention runs every legal "
                         "count")
    ap.add_argument("--only-chunks", action="store_true",
                    help="run (f) alone; without --a2a-chunks its attention part only")
    ap.add_argument("--only-ring", action="store_true",
                    help="run (c) alone: the ring at P=2 on 2 nodes x 1 rank, at --ring-seq-len")
    ap.add_argument("--placement-sweep", default=None,
                    help="only (a) attention, once per INTER:INTRA rate pair, e.g. "
                         "'1gbit:9gbit,200mbit:1800mbit' (INTRA empty: loopback)")
    ap.add_argument("--report-only", action="store_true",
                    help="re-print the tables of OUT/results.json (same size flags as the run)")
    return ap.parse_args(argv)


def config(args: argparse.Namespace) -> ClusterBench:
    fields = {k: v for k, v in vars(args).items()
              if k in ClusterBench.__dataclass_fields__ and k != "a2a_chunks"}
    return ClusterBench(**fields, ring_seq_lens=[int(x) for x in args.ring_seq_len.split(",")],
                        a2a_chunks=ClusterBench.parse_chunks(args.a2a_chunks))


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        cfg = config(args)
        if args.report_only:  # tables and PNGs again from a saved results.json (no root)
            print("\n".join(report_saved(cfg)[1]))
            return 0
        preflight()
    except (SimClusterError, ValueError) as e:
        print(f"bench_cluster: error: {e}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, interrupt_on_signal)  # unwinds through SimCluster's clean-up
    try:
        if args.placement_sweep:
            pairs = [p.partition(":") for p in args.placement_sweep.split(",")]
            lines = placement_sweep(cfg, [(inter, intra or None) for inter, _, intra in pairs])
        elif args.only_ring:
            lines = ring_only(cfg)
        else:
            lines = run(cfg, only_chunks=args.only_chunks)[1]
    except ValueError as e:  # a bad rate in --placement-sweep
        print(f"bench_cluster: error: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:  # a worker or a usp-train run failed: its output is in e
        print(e, file=sys.stderr)
        return 1
    print("\n".join(lines))
    written = ("placement_sweep.txt" if args.placement_sweep else
               "ring.json, ring.txt" if args.only_ring else "results.json, tables.txt")
    print(f"\nwrote {cfg.out}: {written} and *.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
