"""The memory benchmark's printed report and plot (``tools.bench_memory``); the points
come from ``tools.lab.memory_sweep.run``."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from .memory import MIB
from .memory_sweep import FEATURES, MemoryBench, Point, Sweep, predict


def deviation(values: Sequence[float]) -> float:
    """The largest relative distance of ``values`` from their mean (0.1: within +-10%)."""
    mean = sum(values) / len(values)
    return max(abs(v / mean - 1) for v in values)


def _row(bench: MemoryBench, p: Point) -> str:
    m, planned = p.memory, predict(bench, p)
    return (f"{p.features:>12} {p.ulysses * p.ring:>2} {p.ulysses}x{p.ring} {p.per_rank:>6} "
            f"{m.before / MIB:>8.1f} {m.activations / MIB:>8.1f} {m.peak / MIB:>8.1f} "
            f"{m.rss / MIB:>8.1f} {planned.total / MIB:>8.1f} {planned.total / m.peak:>6.2f}  "
            f"{planned.peak_at}")


HEADER = (f"{'features':>12} {'P':>2} {'uxr':>3} {'L/P':>6} {'before':>8} {'act':>8} "
          f"{'peak':>8} {'rss':>8} {'planner':>8} {'pl/pk':>6}  planner's peak moment")


def report(bench: MemoryBench, sweep: Sweep) -> list[str]:
    """The report's lines; the last is ``max_seq_len_per_rank baseline=.. optimized=..
    ratio=..`` when both longest fits were bracketed (else a line says why not)."""
    out = [(f"one training step per point, per rank (busiest rank), MiB: model vocab "
            f"{bench.vocab_size} dim {bench.dim} layers {bench.n_layers} heads "
            f"{bench.n_heads}/{bench.n_kv_heads} ffn {bench.ffn_dim} fp32, batch {bench.batch}, "
            f"gloo CPU; loss_chunk={bench.loss_chunk} mlp_tiles={bench.mlp_tiles}"),
           ("before: live tensor bytes at the step start (state); act = peak - before; peak: "
            "most live tensor bytes in the step; rss: resident high-water - idle resident"),
           HEADER]
    mem = [p for p in sweep.points if not p.timed]
    main = [p for p in mem if (p.ulysses, p.ring) == (bench.ulysses, bench.ring)]
    out += [_row(bench, p) for p in sorted(main, key=lambda p: (list(FEATURES).index(
        p.features), p.per_rank))]
    ratios = [predict(bench, p).total / p.memory.peak for p in mem]
    out.append(f"planner/measured peak over {len(mem)} points: {min(ratios):.2f} .. "
               f"{max(ratios):.2f}")

    out.append(f"longest L/P under a budget of {bench.budget_mib:g} MiB per rank "
               f"(u={bench.ulysses} r={bench.ring}):")
    fits = {}
    for name in ("baseline", "optimized"):
        found = sweep.longest.get(name, "not measured")
        if isinstance(found, str):
            out.append(f"  {name:>9}: no bracket: {found}")
            continue
        at = {n: sweep.find(name, n, bench.world).memory.peak / MIB for n in found}
        out.append(f"  {name:>9}: fits at {found[0]} ({at[found[0]]:.1f} MiB), not at "
                   f"{found[1]} ({at[found[1]]:.1f} MiB)")
        fits[name] = found[0]

    weak = [p for p in mem if p.per_rank == bench.weak_per_rank
            and p.ulysses * p.ring in bench.weak_ranks and p.features in ("baseline", "optimized")]
    if len({p.ulysses * p.ring for p in weak}) > 1:
        out.append(f"weak scaling at L/P={bench.weak_per_rank} (P=1: 1x1, else ulysses 2 x ring "
                   f"P/2):")
        out.append(HEADER)
        for name in ("baseline", "optimized"):
            rows = sorted((p for p in weak if p.features == name), key=lambda p: p.ulysses * p.ring)
            out += [_row(bench, p) for p in rows]
            out.append(f"  {name}: peak within +-{deviation([p.memory.peak for p in rows]):.1%}"
                       f", act within +-{deviation([p.memory.activations for p in rows]):.1%}, "
                       f"before within +-{deviation([p.memory.before for p in rows]):.1%} "
                       f"of the mean over P={[p.ulysses * p.ring for p in rows]}")

    timed = {p.features: p.memory.step_s for p in sweep.points if p.timed}
    if timed:
        out.append(f"step time at L/P={bench.time_per_rank} (no tracker, same run, back to back):")
        out += [f"  {name:>12}: {s:7.2f} s  x{s / timed['baseline']:.2f} vs baseline"
                for name, s in timed.items()]
    if len(fits) == 2:
        out.append(f"max_seq_len_per_rank baseline={fits['baseline']} optimized="
                   f"{fits['optimized']} ratio={fits['optimized'] / fits['baseline']:.2f}")
    return out


def plot(bench: MemoryBench, sweep: Sweep, path: Path) -> None:
    """Peak per rank against L/P, one line per feature setting, and the budget (PNG)."""
    from .plots import _figure, _save

    fig, ax = _figure(6.4)
    for name in FEATURES:
        pts = sorted((p for p in sweep.points if p.features == name and not p.timed
                      and (p.ulysses, p.ring) == (bench.ulysses, bench.ring)),
                     key=lambda p: p.per_rank)
        ax.plot([p.per_rank for p in pts], [p.memory.peak / MIB for p in pts], "o-", ms=3,
                label=name)
    ax.axhline(bench.budget_mib, color="red", lw=1, ls="--", label="budget")
    ax.set_xscale("log", base=2)
    ax.set_xlabel(f"tokens per rank L/P (ulysses {bench.ulysses} x ring {bench.ring})")
    _save(fig, ax, path, "peak live tensor MiB per rank", "one training step, fp32, CPU", True)
