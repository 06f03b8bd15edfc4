"""A mixture of experts' training step at expert degrees 1, 2 and 4 on a simulated 2-node x
2-rank cluster (needs root), beside the planner's prediction of each.

Every row is a real ``usp-train`` run of the built-in Qwen3-MoE from scratch
(``model.arch=qwen3_moe`` with the shape in ``model.*``, no checkpoint) at ulysses 2 x ring
2 with ``parallel.expert_degree`` N; the runs share one simulated cluster and take turns,
the order reversed every other pass. Per degree: tokens/s, median step, the ratio to degree
1 (of the best pass, and pass by pass), the planner's predicted step and its expert
all-to-all. Logic: ``tools.lab.moe_bench``; the table goes to stdout and ``OUT/table.txt``,
everything to ``OUT/results.json``.

    python -m tools.bench_moe                                     # 300mbit / 2700mbit, L=4096
    python -m tools.bench_moe --plan-only                         # the planner's figures alone
    python -m tools.bench_moe --report-only --out runs/bench_moe  # the table again
    python -m tools.bench_moe --seq-len 256 --layers 1 --steps 3 --skip 1 --passes 1 --out /tmp/bm
"""

from __future__ import annotations

import argparse
import signal
import sys

from tools.lab.cli import add_cluster_args
from tools.lab.moe_bench import MoeBench, plan_lines, prepare, report_saved, run
from tools.lab.simcluster import SimClusterError, interrupt_on_signal, preflight


def parse_degrees(text: str) -> tuple[int, ...]:
    """'1,2,4' -> (1, 2, 4); ValueError naming a bad item."""
    items = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in items if not (x.isdigit() and int(x) >= 1)]
    if bad or not items:
        raise ValueError(f"--degrees takes integers >= 1, comma-separated; got {text!r}, "
                         f"e.g. 1,2,4")
    return tuple(int(x) for x in items)


def parse_args(argv=None) -> argparse.Namespace:
    d = MoeBench()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_cluster_args(ap, d)
    ap.add_argument("--experts", type=int, default=d.n_experts)
    ap.add_argument("--top-k", type=int, default=d.experts_per_token)
    ap.add_argument("--expert-ffn-dim", type=int, default=d.expert_ffn_dim)
    ap.add_argument("--vocab", type=int, default=d.vocab_size)
    ap.add_argument("--seq-len", type=int, default=d.seq_len)
    ap.add_argument("--batch", type=int, default=d.batch)
    ap.add_argument("--ulysses", type=int, default=d.ulysses)
    ap.add_argument("--ring", type=int, default=d.ring)
    ap.add_argument("--degrees", default=",".join(map(str, d.degrees)),
                    help="expert degrees, comma-separated, 1 among them")
    ap.add_argument("--steps", type=int, default=d.steps, help="steps of each usp-train run")
    ap.add_argument("--skip", type=int, default=d.skip, help="first steps of a run dropped")
    ap.add_argument("--passes", type=int, default=d.passes)
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--timeout", type=float, default=d.timeout, help="per usp-train run, s")
    ap.add_argument("--plan-only", action="store_true",
                    help="print the planner's figures and start nothing")
    ap.add_argument("--report-only", action="store_true",
                    help="the table again from OUT/results.json (same settings)")
    return ap.parse_args(argv)


def config(args: argparse.Namespace) -> MoeBench:
    intra = None if str(args.intra_rate).lower() in ("none", "") else args.intra_rate
    return MoeBench(out=args.out, rate=args.rate, intra_rate=intra, queue_ms=args.queue_ms,
                    dim=args.dim, n_heads=args.heads, n_kv_heads=args.kv_heads,
                    n_layers=args.layers, n_experts=args.experts,
                    experts_per_token=args.top_k, expert_ffn_dim=args.expert_ffn_dim,
                    vocab_size=args.vocab, seq_len=args.seq_len, batch=args.batch,
                    ulysses=args.ulysses, ring=args.ring, degrees=parse_degrees(args.degrees),
                    steps=args.steps, skip=args.skip, passes=args.passes, seed=args.seed,
                    timeout=args.timeout)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:  # every refusal before a namespace exists
        plan = prepare(config(args))
        if args.plan_only:
            print("\n".join(plan_lines(plan)))
            return 0
        if args.report_only:
            print("\n".join(report_saved(plan)[1]))
            return 0
        preflight()
    except (SimClusterError, ValueError) as e:
        print(f"bench_moe: error: {e}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, interrupt_on_signal)  # unwinds through SimCluster's clean-up
    try:
        _, lines = run(plan)
    except RuntimeError as e:  # a usp-train run failed: its output is in e
        print(e, file=sys.stderr)
        return 1
    print("\n".join(lines))
    print(f"\nwrote {plan.cfg.out}: results.json, table.txt")
    return 0


if __name__ == "__main__":
    sys.exit(main())
