"""Forward+backward time of one attention call: usp layouts side by side with DeepSpeed-Ulysses.

How it measures, the rows and the columns: ``usp/bench/attention.py``. Started plainly it
spawns ``--nprocs`` local gloo processes; under torchrun (e.g. through tools.simcluster)
each process is one rank and ``--nprocs`` is the launch's world size.

    python -m tools.bench_attention                       # B=1 L=8192 H=8 d=64 causal fp32
    python -m tools.bench_attention --quick               # small, for a smoke test
    python -m tools.bench_attention --layouts 4x1,2x2 --kv-heads 4 --json out.json
    python -m tools.bench_attention --layouts 4x1 --a2a-chunks 1,2,4 --seq-len 2048
"""

from __future__ import annotations

import argparse
import json
from dataclasses import fields
from pathlib import Path

from usp.bench.attention import (DTYPES, QUICK, AttentionBench, launched_world, measure,
                                 parse_layouts)
from usp.bench.attention_report import format_report
from tools.lab.deepspeed_ulysses import deepspeed_peer

FULL = {f.name: f.default for f in fields(AttentionBench) if f.name in QUICK}


def parse_args(argv=None) -> tuple[AttentionBench, Path | None]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nprocs", type=int, default=4,
                   help="local gloo processes (= sp size); under torchrun: its world size")
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
    p.add_argument("--a2a-chunks", default="1",
                   help="pipeline stages of the ulysses all-to-alls, comma-separated: a usp "
                        "row per count for each layout with ulysses > 1 (default 1)")
    p.add_argument("--quick", action="store_true",
                   help=f"smoke-test size: L={QUICK['seq_len']}, warmup {QUICK['warmup']}, "
                        f"iters {QUICK['iters']} (explicit flags still win)")
    p.add_argument("--json", type=Path, default=None, help="write results here")
    args = p.parse_args(argv)
    preset = QUICK if args.quick else FULL
    sizes = {key: val if getattr(args, key) is None else getattr(args, key)
             for key, val in preset.items()}
    try:  # refuse before any process starts
        try:
            chunks = tuple(int(c) for c in args.a2a_chunks.split(","))
        except ValueError:
            raise ValueError(f"bad --a2a-chunks {args.a2a_chunks!r}: write counts like 1,2,4") \
                from None
        bench = AttentionBench(
            nprocs=launched_world() or args.nprocs, batch=args.batch, heads=args.heads,
            kv_heads=args.kv_heads, head_dim=args.head_dim, causal=args.causal,
            dtype=args.dtype, balance=args.balance, threads=args.threads,
            layouts=parse_layouts(args.layouts) if args.layouts else None,
            peer=None if args.no_deepspeed else deepspeed_peer, a2a_chunks=chunks, **sizes)
    except ValueError as e:
        p.error(str(e))
    return bench, args.json


def main(argv=None) -> None:
    bench, json_path = parse_args(argv)
    result = measure(bench)
    if result is None:  # a rank other than 0 of a torchrun launch
        return
    print(format_report(result))
    if json_path:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(result, indent=2))
        print(f"wrote {json_path}")


if __name__ == "__main__":
    main()
