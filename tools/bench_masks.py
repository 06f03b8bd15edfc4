"""Time sliding-window and packed-document attention against full causal attention.

    python tools/bench_masks.py --quick        # L=2048, smoke-test size
    python tools/bench_masks.py                # L=8192, window L/8, (u,r) = (1,4) and (2,2)
    python tools/bench_masks.py --window 512 --doc-len 256 --layouts 1x4

All rows of a layout run interleaved in one set of processes; see ``usp.bench.masks`` for
what is measured and what the kernel-call columns mean.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from usp.bench.masks import DTYPES, MasksBench, report, run  # noqa: E402

QUICK = dict(seq_len=2048, rounds=3, head_dim=32, doc_len=256)
FULL = dict(seq_len=8192, rounds=3, head_dim=64, doc_len=512)


def parse_layouts(text: str) -> tuple[tuple[int, int], ...]:
    try:
        return tuple(tuple(int(x) for x in item.split("x")) for item in text.split(","))
    except ValueError:
        raise ValueError(f"bad --layouts {text!r}: write ULYSSESxRING,..., e.g. 1x4,2x2") from None


def parse_args(argv=None) -> MasksBench:
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
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--rounds", type=int, default=None, help=f"default {FULL['rounds']}")
    p.add_argument("--threads", type=int, default=None, help="intra-op threads per process")
    p.add_argument("--quick", action="store_true",
                   help=f"smoke-test size {QUICK} (explicit flags still win)")
    args = p.parse_args(argv)
    for key, val in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, val)
    try:
        return MasksBench(layouts=parse_layouts(args.layouts), batch=args.batch,
                          seq_len=args.seq_len, heads=args.heads,
                          kv_heads=args.kv_heads or args.heads, head_dim=args.head_dim,
                          dtype=args.dtype, window=args.window, doc_len=args.doc_len,
                          warmup=args.warmup, rounds=args.rounds, threads=args.threads)
    except ValueError as e:  # refuse before any process starts
        p.error(str(e))


def main(argv=None) -> None:
    cfg = parse_args(argv)
    print(report(cfg, run(cfg)))


if __name__ == "__main__":
    main()
