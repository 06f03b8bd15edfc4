"""Ring work balance of packed real documents: zigzag against per_document.

    python -m tools.bench_balance                          # L=32768, r=2,4,8; time at r=2
    python -m tools.bench_balance --lens 8192,32768,131072 --every 1
    python -m tools.bench_balance --quick                  # L=8192, every 8th row, 2 timed rows

The Python standard library's ``.py`` files (``tools.lab.balance``) packed in path order
into rows of L tokens; per row, every ring rank's counted (query, key) pairs of the ring's
own plan (``usp.bench.balance``); the busiest rank's work over the mean, mean and p90
over rows. Then the time of a ring attention forward + backward at r=2 on ``--time-rows``
rows drawn at random (``--seed``) from the corpus's rows, both balances interleaved round
by round; the ratio is the median of the per-round ratios per_document / zigzag, of the
slowest rank's wall time and of the busiest rank's CPU time. ``--plans``: each row's plan
built in the timed call (``call``), or once and reused (``reuse``, as ``usp_attention``
reuses a layout's plans over a model's layers), or both interleaved (``call,reuse``).
"""

from __future__ import annotations

import argparse

from usp.bench.balance import (BALANCES, imbalance, mean_p90, packed_rows, rank_work,
                               sample_rows)
from usp.bench.timing import time_ratios
from tools.lab.balance import stdlib_doc_lens, stdlib_root, time_rows


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--root", default=stdlib_root(), help="the standard library's folder")
    p.add_argument("--lens", default=None, help="row lengths L, comma separated (32768)")
    p.add_argument("--rings", default="2,4,8", help="ring degrees counted ('': none)")
    p.add_argument("--every", type=int, default=None, help="count every n-th row (1)")
    p.add_argument("--time-len", type=int, default=32768)
    p.add_argument("--time-rows", type=int, default=None, help="rows timed at r=2 (6; 0: no timing)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--seed", type=int, default=0, help="draws the timed rows")
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--plans", default="reuse",
                   help="call (plans built in the timed call), reuse (built once, reused), "
                        "or call,reuse (both, interleaved)")
    p.add_argument("--quick", action="store_true")
    return p


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def counted(lens, seq_len: int, rings, every: int) -> None:
    rows = packed_rows(lens, seq_len)[::every]
    for ring in rings:
        stats = {b: mean_p90([imbalance(rank_work(d, ring, b)) for d in rows]) for b in BALANCES}
        print(f"balance: L={seq_len} r={ring} " + " ".join(
            f"{b}={m:.3f}/{p90:.3f}" for b, (m, p90) in stats.items()) + f" rows={len(rows)}",
            flush=True)


def timing(lens, args) -> str:
    rows = packed_rows(lens, args.time_len)
    picked = sample_rows(len(rows), args.time_rows, args.seed)
    chosen = [rows[i] for i in picked]
    busiest = {b: sum(max(rank_work(d, 2, b)) for d in chosen) for b in BALANCES}
    print(f"timed rows: {len(chosen)} of {len(rows)} drawn with seed {args.seed}: {picked}; "
          f"documents per row {[len(d) for d in chosen]}; counted busiest-rank work "
          f"per_document/zigzag {busiest['per_document'] / busiest['zigzag']:.3f}", flush=True)
    plans = args.plans.split(",")
    times = time_rows(chosen, args.heads, args.head_dim, args.rounds, plans)
    lines = []
    for m, mode in enumerate(plans):  # variants: BALANCES within each plans mode
        for clock in ("wall", "cpu"):
            zig, per = ([t[m * len(BALANCES) + j] for t in times[clock]]
                        for j in range(len(BALANCES)))
            print(f"plans={mode} {clock}: per-round ratios per_document/zigzag: "
                  + " ".join(f"{p / z:.3f}" for p, z in zip(per, zig)), flush=True)
            ratio = time_ratios(per, zig)["paired_median"]
            med = sorted(zig)[len(zig) // 2] * 1e3, sorted(per)[len(per) // 2] * 1e3
            lines.append(f"balance time: L={args.time_len} r=2 plans={mode} {clock} "
                         f"zigzag_ms={med[0]:.0f} per_document_ms={med[1]:.0f} "
                         f"ratio={ratio:.3f} rows={len(chosen)} rounds={args.rounds}")
    return "\n".join(lines)


def main(argv=None) -> None:
    args = _parser().parse_args(argv)
    if args.quick:
        args.lens = args.lens or "8192"
        args.every, args.time_len = args.every or 8, 8192
        args.time_rows = 2 if args.time_rows is None else args.time_rows
        args.rounds = min(args.rounds, 3)
    lens = stdlib_doc_lens(args.root)
    print(f"corpus: {args.root}: {len(lens)} documents, {sum(lens)} tokens", flush=True)
    for seq_len in _ints(args.lens or "32768") if args.rings else ():
        counted(lens, seq_len, _ints(args.rings), args.every or 1)  # prints its lines
    args.time_rows = 6 if args.time_rows is None else args.time_rows
    if args.time_rows:
        print(timing(lens, args))


if __name__ == "__main__":
    main()
