"""Whole training steps of three layouts on a simulated 2-node x 2-rank cluster (needs root).

Rows: the planner's choice (usp, ulysses inside nodes x ring across them), all-ulysses with
DeepSpeed-Ulysses (u=4 across the nodes) and ring-only (usp, r=4); the built-in Llama,
FSDP2 and AdamW as usp-train steps, all rows in the same processes, timed round-robin.
Per row: tokens/s, median step, spread, and the planner's predicted step. The rows' losses
on the same batch are checked to agree before anything is timed. Logic:
``tools.lab.train_table``; the table goes to stdout and ``OUT/table.txt``, everything to
``OUT/results.json``.

    python -m tools.train_table                               # 300mbit / 2700mbit, L=4096
    python -m tools.train_table --seq-len 256 --layers 1 --warmup 1 --rounds 2 --out /tmp/tt
"""

from __future__ import annotations

import argparse
import signal
import sys

from tools.lab.cli import add_cluster_args
from tools.lab.simcluster import SimClusterError, interrupt_on_signal, preflight
from tools.lab.train_table import TrainTable, check_deepspeed, prepare, run


def parse_args(argv=None) -> argparse.Namespace:
    d = TrainTable()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_cluster_args(ap, d)
    ap.add_argument("--ffn-dim", type=int, default=d.ffn_dim)
    ap.add_argument("--vocab", type=int, default=d.vocab_size)
    ap.add_argument("--seq-len", type=int, default=d.seq_len)
    ap.add_argument("--batch", type=int, default=d.batch)
    ap.add_argument("--warmup", type=int, default=d.warmup)
    ap.add_argument("--rounds", type=int, default=d.rounds)
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--loss-rtol", type=float, default=d.loss_rtol,
                    help="the rows' losses on the checked step must agree within this")
    ap.add_argument("--timeout", type=float, default=d.timeout, help="kill the workers after N s")
    return ap.parse_args(argv)


def config(args: argparse.Namespace) -> TrainTable:
    intra = None if str(args.intra_rate).lower() in ("none", "") else args.intra_rate
    return TrainTable(out=args.out, rate=args.rate, intra_rate=intra, queue_ms=args.queue_ms,
                      dim=args.dim, n_heads=args.heads, n_kv_heads=args.kv_heads,
                      n_layers=args.layers, ffn_dim=args.ffn_dim, vocab_size=args.vocab,
                      seq_len=args.seq_len, batch=args.batch, warmup=args.warmup,
                      rounds=args.rounds, seed=args.seed, loss_rtol=args.loss_rtol,
                      timeout=args.timeout)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:  # every refusal before a namespace exists
        plan = prepare(config(args))
        preflight()
        check_deepspeed()
    except (SimClusterError, ValueError) as e:
        print(f"train_table: error: {e}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, interrupt_on_signal)  # unwinds through SimCluster's clean-up
    try:
        _, lines = run(plan)
    except RuntimeError as e:  # a worker failed, the loss check among them: its output is in e
        print(e, file=sys.stderr)
        return 1
    print("\n".join(lines))
    print(f"\nwrote {plan.cfg.out}: results.json, table.txt")
    return 0


if __name__ == "__main__":
    sys.exit(main())
