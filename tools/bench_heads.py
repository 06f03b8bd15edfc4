"""Time an uneven head split against the nearest even ones on the same ranks.

    python -m tools.bench_heads --quick                  # 6 heads vs 4 and 8 on ulysses 4
    python -m tools.bench_heads --heads 6 --kv-heads 2   # GQA: 6/2 vs 12/4
    python -m tools.bench_heads --heads 8 --kv-heads 2 --ulysses 3

Rows: the given (heads, KV heads) first, then ``tools.lab.heads.even_neighbours`` (same
query heads per KV head, dividing evenly over ulysses), or ``--compare 8:8,4:4``. All rows
run interleaved in one set of processes; see ``tools.lab.heads`` for what is measured.
"""

from __future__ import annotations

import argparse

from tools.lab.cli import DTYPES, BenchScript
from tools.lab.heads import HeadsBench, even_neighbours, report, run

QUICK = dict(seq_len=1024, rounds=5, head_dim=32)
FULL = dict(seq_len=4096, rounds=7, head_dim=64)


def parse_pairs(text: str) -> list[tuple[int, int]]:
    try:
        return [tuple(int(x) for x in item.split(":")) for item in text.split(",")]
    except ValueError:
        raise ValueError(f"bad --compare {text!r}: write HEADS:KV_HEADS,..., e.g. 8:8,4:4") from None


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--heads", type=int, default=6, help="query heads of the uneven row")
    p.add_argument("--kv-heads", type=int, default=None, help="KV heads (default: --heads)")
    p.add_argument("--compare", default=None, help="rows to compare with, HEADS:KV,...")
    p.add_argument("--ulysses", type=int, default=4)
    p.add_argument("--ring", type=int, default=1)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=None, help=f"default {FULL['seq_len']}")
    p.add_argument("--head-dim", type=int, default=None, help=f"default {FULL['head_dim']}")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--balance", choices=("zigzag", "contiguous"), default="zigzag")
    return p


def _config(args: argparse.Namespace) -> HeadsBench:
    uneven = (args.heads, args.kv_heads or args.heads)
    others = parse_pairs(args.compare) if args.compare else even_neighbours(*uneven, args.ulysses)
    return HeadsBench(heads=(uneven, *others), ulysses=args.ulysses, ring=args.ring,
                      batch=args.batch, seq_len=args.seq_len, head_dim=args.head_dim,
                      dtype=args.dtype, balance=args.balance, warmup=args.warmup,
                      rounds=args.rounds, threads=args.threads)


SCRIPT = BenchScript(_parser, FULL, QUICK, _config, run, report)
parse_args, main = SCRIPT.parse_args, SCRIPT.main

if __name__ == "__main__":
    main()
