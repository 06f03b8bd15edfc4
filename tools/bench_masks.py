"""Time sliding-window and packed-document attention against full causal attention.

    python -m tools.bench_masks --quick        # L=2048, smoke-test size
    python -m tools.bench_masks                # L=8192, window L/8, (u,r) = (1,4) and (2,2)
    python -m tools.bench_masks --window 512 --doc-len 256 --layouts 1x4

All rows of a layout run interleaved in one set of processes; see ``tools.lab.masks`` for
what is measured and what the kernel-call columns mean.
"""

from __future__ import annotations

import argparse

from usp.bench.attention import parse_layouts
from tools.lab.cli import DTYPES, BenchScript
from tools.lab.masks import MasksBench, report, run

QUICK = dict(seq_len=2048, rounds=3, head_dim=32, doc_len=256)
FULL = dict(seq_len=8192, rounds=3, head_dim=64, doc_len=512)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layouts", default="1x4,2x2", help="ULYSSESxRING,... (one world size)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=None, help=f"default {FULL['seq_len']}")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=None, help="default: --heads")
    p.add_argument("--head-dim", type=int, default=None, help=f"default {FULL['head_dim']}")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--window", type=int, default=None, help="default seq_len // 8")
    p.add_argument("--doc-len", type=int, default=None, help=f"default {FULL['doc_len']}")
    return p


def _config(args: argparse.Namespace) -> MasksBench:
    return MasksBench(layouts=parse_layouts(args.layouts), batch=args.batch,
                      seq_len=args.seq_len, heads=args.heads,
                      kv_heads=args.kv_heads or args.heads, head_dim=args.head_dim,
                      dtype=args.dtype, window=args.window, doc_len=args.doc_len,
                      warmup=args.warmup, rounds=args.rounds, threads=args.threads)


SCRIPT = BenchScript(_parser, FULL, QUICK, _config, run, report)
parse_args, main = SCRIPT.parse_args, SCRIPT.main

if __name__ == "__main__":
    main()
