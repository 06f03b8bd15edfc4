"""Calibration of the cost model: fits from measured times, and measured vs predicted.

Pure functions over numbers already measured (``usp.bench.calibrate`` measures them on
gloo processes). Predictions come from ``usp.planner.cost.attention_cost``, the attention
part of ``estimate``; ``predict_attention`` only sums its terms for a batch.

Repeated times are summarized by a statistic of ``STATS`` (``min`` by default: load from
other processes only adds time).
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from ..rules import FIXED_BALANCES, seq_multiple

from ..dims.heads import check_heads
from ..config.cluster import ClusterSpec, load_cluster
from .cost import FLASH_BWD, attention_cost

# kernel probes [1, n, heads, 64]: causal at the (u=4, r=1, L=4096) per-rank work, and
# non-causal, whose rate has no diagonal waste
PROBE = (4096, 2)
PROBE_NC = (2048, 2)
FULL = dict(seq_lens=(2048, 4096, 8192), warmup=1, iters=4)  # presets of CalibrationSetup
QUICK = dict(seq_lens=(1024, 2048), warmup=1, iters=2)
STATS = {"min": min, "median": statistics.median_low}


@dataclass
class CalibrationSetup:
    """What one calibration run measures: ``nprocs`` gloo processes x ``threads`` threads,
    attention ``[batch, L, heads|kv_heads, head_dim]`` for each ``(ulysses, ring)`` of
    ``layouts`` at each L of ``seq_lens``, ``warmup`` + ``iters`` round-robin rounds; the
    large all-to-all sends ``a2a_kib`` KiB per peer, the large ring step ``p2p_kib`` KiB."""

    nprocs: int = 4
    threads: int = 1
    seq_lens: tuple[int, ...] = FULL["seq_lens"]
    layouts: tuple[tuple[int, int], ...] = ((4, 1), (2, 2), (1, 4))
    batch: int = 1
    heads: int = 8
    kv_heads: int | None = None  # None: heads
    head_dim: int = 64
    balance: str = "zigzag"
    warmup: int = FULL["warmup"]
    iters: int = FULL["iters"]
    a2a_kib: int = 4096
    p2p_kib: int = 16384
    overlap_reps: int = 7

    def __post_init__(self) -> None:
        self.kv_heads = self.kv_heads or self.heads
        self.seq_lens, self.layouts = tuple(self.seq_lens), tuple(map(tuple, self.layouts))
        if self.balance not in FIXED_BALANCES:
            raise ValueError(f"balance must be one of {FIXED_BALANCES}, got {self.balance!r}")
        if min(self.nprocs, self.threads, self.iters, self.overlap_reps) < 1 or self.warmup < 0:
            raise ValueError(f"nprocs ({self.nprocs}), threads ({self.threads}), iters "
                             f"({self.iters}) and overlap_reps ({self.overlap_reps}) must be "
                             f">= 1 and warmup ({self.warmup}) >= 0")
        for u, r in self.layouts:
            if u * r != self.nprocs:
                raise ValueError(f"layout {u}x{r} does not use all {self.nprocs} processes; "
                                 f"use ULYSSESxRING with ulysses * ring = {self.nprocs}")
            check_heads(self.heads, self.kv_heads, u)
            m = seq_multiple(u, r, self.balance)
            for L in self.seq_lens:
                if L % m:
                    raise ValueError(f"seq_len {L} is not a multiple of {m} for layout {u}x{r}"
                                     f" ({self.balance}); use {max(m, L // m * m)}")


@dataclass(frozen=True)
class AttentionShape:
    """One attention call: global [B, L, H, d] query, [B, L, Hkv, d] keys/values."""

    batch: int
    seq_len: int
    heads: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int = 4
    causal: bool = True


def predict_attention(spec: ClusterSpec, shape: AttentionShape, ulysses: int, ring: int,
                      balance: str = "zigzag", *, overlap: float | None = None,
                      causal_tile: float = 0.0) -> dict:
    """The cost model's seconds for one attention call on one rank: ``fwd_bwd`` split into
    ``compute`` (kernel FLOPs), ``merge``, ``a2a`` and ``ring_exposed``, and ``fwd``.

    ``attention_cost`` runs the forward ``n_fwd`` times and nothing else depends on it, so
    the forward alone is the cost with ``n_fwd=2`` less the cost with ``n_fwd=1``.
    ``overlap`` and ``causal_tile`` go to ``attention_cost``."""

    def terms(n_fwd: int) -> dict:
        c = attention_cost(spec, shape.seq_len, shape.heads, shape.kv_heads, shape.head_dim,
                           ulysses, ring, dtype_bytes=shape.dtype_bytes, causal=shape.causal,
                           balance=balance, n_fwd=n_fwd, overlap=overlap,
                           causal_tile=causal_tile)
        b = shape.batch
        return dict(compute=b * c.compute_s, merge=b * c.merge_s, a2a=b * c.a2a_s,
                    ring_exposed=b * c.ring_exposed_s)

    once, twice = terms(1), terms(2)
    fwd_bwd = sum(once.values())
    return dict(once, fwd_bwd=fwd_bwd, fwd=sum(twice.values()) - fwd_bwd)


def causal_tile_from_rates(n: int, causal_rate: float, full_rate: float) -> float:
    """Diagonal waste (tokens) that makes an n x n causal block run at ``causal_rate`` when
    unmasked blocks run at ``full_rate``: causal_rate = full_rate * n / (n + tile)."""
    return max(0.0, n * (full_rate / causal_rate - 1))


def fit_a2a_overlap(spec: ClusterSpec, cases: Sequence[tuple[float, dict]]) -> float:
    """The ``a2a_overlap`` in [0, 1] whose predicted gains of the pipelined all-to-all come
    closest to the measured ones: the least worst relative error over ``cases``, each
    (measured gain = time at 1 stage / time at ``kw["a2a_chunks"]`` stages, ``kw``:
    ``attention_cost``'s arguments by name, layout and shape included). A grid of 0.005
    steps; the smaller share on a tie."""
    if not cases or any(kw.get("a2a_chunks", 1) < 2 for _, kw in cases):
        raise ValueError("fit_a2a_overlap needs measured gains at pipelined counts "
                         "(a2a_chunks >= 2)")

    # one stage hides nothing behind a neighbouring stage: its time is the share's alike
    one = [attention_cost(spec, **{**kw, "a2a_chunks": 1}).total_s for _, kw in cases]

    def worst(share: float) -> float:
        return max(abs(t1 / attention_cost(spec, **kw, a2a_overlap=share).total_s / gain - 1)
                   for t1, (gain, kw) in zip(one, cases))

    grid = [i / 200 for i in range(201)]
    return min(grid, key=lambda share: (worst(share), share))


def fit_link(small_bytes: float, small_s: float, large_bytes: float,
             large_s: float) -> tuple[float, float]:
    """(bytes/s, latency s) of ``t = latency + bytes / bw`` through two measured points.

    ``bytes`` is what one rank sends to others. If the large message was not slower (noise),
    the bandwidth is the large message's plain rate and the latency the small one's time."""
    if large_s <= small_s or large_bytes <= small_bytes:
        return large_bytes / large_s, small_s
    bw = (large_bytes - small_bytes) / (large_s - small_s)
    return bw, max(small_s - small_bytes / bw, 1e-9)


def calibrated_spec(base: ClusterSpec, micro: dict) -> ClusterSpec:
    """``base`` with this machine's measured links, kernel rate and merge bandwidth.

    all-to-all -> intra_*, P2P ring step -> inter_* (the CPU recipes simulate nodes whose
    ring crosses them); ``mfu`` = achieved attention FLOP/s per rank / ``peak_flops``."""
    return base.replace(
        intra_bw=micro["a2a_bw"], intra_latency_s=micro["a2a_lat_s"],
        inter_bw=micro["p2p_bw"], inter_latency_s=micro["p2p_lat_s"],
        mfu=min(1.0, micro["kernel_flops"] / base.peak_flops), hbm_bw=micro["merge_bw"],
    )


def yaml_lines(spec: ClusterSpec) -> str:
    """The ClusterSpec as ``configs/cluster/*.yaml`` lines (field order of the dataclass)."""
    out = []
    for key, val in asdict(spec).items():
        if val is None:  # an optional figure not measured: left out (load_cluster's default)
            continue
        if key == "mem_bytes" or not isinstance(val, float):
            val = int(val) if key == "mem_bytes" else val
        elif key == "mfu":
            val = f"{val:.4f}"
        else:
            mant, exp = f"{val:.3e}".split("e")
            val = f"{mant}e{int(exp):+d}"
        out.append(f"{key}: {val}")
    return "\n".join(out)


def ranking(times: dict) -> list:
    """Keys ordered fastest first."""
    return sorted(times, key=times.get)


def pairwise_agreement(rounds: dict, predicted: dict) -> tuple[int, int, int]:
    """(agree, resolved, pairs) over all pairs of configs.

    ``rounds``: config -> per-round measured times (same rounds for all); a pair is
    *resolved* when one config was faster in every round; ``agree`` counts resolved pairs
    whose faster config the model also predicts faster."""
    names = list(rounds)
    agree = resolved = pairs = 0
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            pairs += 1
            wins = [x < y for x, y in zip(rounds[a], rounds[b], strict=True)]
            if all(wins) or not any(wins):
                resolved += 1
                agree += (predicted[a] < predicted[b]) == wins[0]
    return agree, resolved, pairs


def overlap_share(kernel_s: Sequence[float], comm_s: Sequence[float],
                  both_s: Sequence[float]) -> float:
    """Share of the shorter of (kernel, transfer) hidden when both run at once, per
    repetition (the three were timed back to back), median over repetitions, in [0, 1]."""
    if not (len(kernel_s) == len(comm_s) == len(both_s)) or not kernel_s:
        raise ValueError(f"overlap_share needs equally many (>= 1) kernel, transfer and "
                         f"combined times, got {len(kernel_s)}, {len(comm_s)}, {len(both_s)}")
    shares = [(c + x - b) / min(c, x) for c, x, b in zip(kernel_s, comm_s, both_s, strict=True)]
    return min(1.0, max(0.0, STATS["median"](shares)))


def summarize_micro(m: dict, nprocs: int, threads: int) -> dict:
    """Link fits, merge bandwidth, kernel rates and diagonal waste from the micro numbers
    (one statistic per measurement already taken) and the overlap share ``m["overlap"]``.
    Kernel rates are counted the model's way: causal = half the square, fwd+bwd = 1 +
    ``FLASH_BWD`` forwards."""
    a2a_bw, a2a_lat = fit_link(m["a2a_small_bytes"], m["a2a_small_s"], m["a2a_large_bytes"],
                               m["a2a_large_s"])
    p2p_bw, p2p_lat = fit_link(m["p2p_small_bytes"], m["p2p_small_s"], m["p2p_large_bytes"],
                               m["p2p_large_s"])
    fwd_flops = 4 * PROBE[0] ** 2 * PROBE[1] * 64 / 2
    tf, tfb = m["kernel_fwd_s"], m["kernel_fb_s"]
    causal_rate = (1 + FLASH_BWD) * fwd_flops / tfb
    full_rate = (1 + FLASH_BWD) * 4 * PROBE_NC[0] ** 2 * PROBE_NC[1] * 64 / m["kernel_nc_s"]
    return dict(a2a_bw=a2a_bw, a2a_lat_s=a2a_lat, p2p_bw=p2p_bw, p2p_lat_s=p2p_lat,
                merge_bw=m["merge_bytes"] / m["merge_s"], kernel_flops=causal_rate,
                kernel_fwd_flops=fwd_flops / tf, bwd_over_fwd=(tfb - tf) / tf,
                kernel_nc_flops=full_rate,
                causal_tile=causal_tile_from_rates(PROBE[0], causal_rate, full_rate),
                overlap=m["overlap"], nprocs=nprocs, threads=threads)


def compare_predictions(setup: CalibrationSetup, res: dict, stat: str = "min") -> dict:
    """Calibrate ``cpu_local`` from the measured ``res`` (``usp.bench.calibrate.measure``),
    predict every attention call and compare, summarizing repeated times with
    ``STATS[stat]``. Two predictions per call: ``pred`` (the calibrated spec as the planner
    uses it) and ``proto`` (measured ``overlap`` and ``causal_tile``, ``mfu`` at the
    unmasked kernel rate)."""
    if stat not in STATS:
        raise ValueError(f"stat must be one of {sorted(STATS)}, got {stat!r}")
    f, rounds = STATS[stat], res["rounds"]
    m = {k: f(v) if isinstance(v, list) else v for k, v in res["micro"].items()}
    m["overlap"] = overlap_share(*(res["micro"][k] for k in ("ovl_kernel_s", "ovl_comm_s",
                                                            "ovl_both_s")))
    m["kernel_fwd_s"] = f(rounds["kernel fwd"])
    m["kernel_fb_s"] = f(rounds["kernel fwd+bwd"])
    m["kernel_nc_s"] = f(rounds["kernel fwd+bwd non-causal"])
    cal = summarize_micro(m, setup.nprocs, setup.threads)
    spec = calibrated_spec(load_cluster("cpu_local"), cal)
    local_spec = spec.replace(ranks_per_node=setup.nprocs, nodes=1)  # all ranks on one host
    # proto counts FLOPs at the unmasked rate and charges the diagonal separately
    proto_spec = local_spec.replace(mfu=min(1.0, cal["kernel_nc_flops"] / spec.peak_flops))
    proto_kw = dict(overlap=cal["overlap"], causal_tile=cal["causal_tile"])
    rows, orders = [], []
    for L in setup.seq_lens:
        shape = AttentionShape(setup.batch, L, setup.heads, setup.kv_heads, setup.head_dim)
        meas, pred, proto, comp, per_round = {}, {}, {}, {}, {}
        for u, r in setup.layouts:
            name = f"u={u} r={r}"
            full, loc = rounds[f"usp L={L} {name}"], rounds[f"local L={L} {name}"]
            p = predict_attention(local_spec, shape, u, r, setup.balance)
            q = predict_attention(proto_spec, shape, u, r, setup.balance, **proto_kw)
            row = dict(L=L, config=name, measured_s=f(full), compute_s=f(loc),
                       pred_s=p["fwd_bwd"], pred_compute_s=p["compute"] + p["merge"],
                       pred_comm_s=p["a2a"] + p["ring_exposed"], proto_s=q["fwd_bwd"])
            row["rest_s"] = row["measured_s"] - row["compute_s"]
            rows.append(row)
            meas[name], pred[name], proto[name] = row["measured_s"], row["pred_s"], row["proto_s"]
            comp[name], per_round[name] = row["compute_s"], full
        agree, resolved, pairs = pairwise_agreement(per_round, pred)
        orders.append(dict(L=L, measured=ranking(meas), predicted=ranking(pred),
                           proto=ranking(proto), compute_only=ranking(comp), agree=agree,
                           proto_agree=pairwise_agreement(per_round, proto)[0],
                           resolved=resolved, pairs=pairs))
    summary = {}
    for key, label, order in (("pred_s", "model", "predicted"), ("proto_s", "proto", "proto")):
        ratios = [r[key] / r["measured_s"] for r in rows]
        same = sum(o["measured"] == o[order] for o in orders)
        summary[label] = dict(min=min(ratios), median=STATS["median"](ratios), max=max(ratios),
                              same_order=same, lengths=len(orders))
    return dict(stat=stat, micro=m, calibration=cal, spec=spec, rows=rows, orders=orders,
                summary=summary)


def summary_lines(ev: dict) -> list[str]:
    """One line per prediction (model, proto): its ratios to measured and ranking hits."""
    return [f"{label}/measured ({ev['stat']} of rounds) over {len(ev['rows'])} calls: "
            f"min {s['min']:.3f}, median {s['median']:.3f}, max {s['max']:.3f}; same order "
            f"as measured at {s['same_order']} of {s['lengths']} lengths"
            for label, s in ev["summary"].items()]


def format_report(setup: CalibrationSetup, res: dict, stat: str = "min") -> tuple[str, dict]:
    """(report text, ``{stat: evaluation, other stat: evaluation}`` as JSON-able dicts)."""
    ev = compare_predictions(setup, res, stat)
    other = compare_predictions(setup, res, "median" if stat == "min" else "min")
    m, cal, out = ev["micro"], ev["calibration"], []
    out += [
        f"\n== this machine: {setup.nprocs} gloo processes x {setup.threads} thread(s), "
        f"{os.cpu_count()} CPUs; {stat} over repetitions ==",
        f"all_to_all_single  small {m['a2a_small_s'] * 1e3:7.3f} ms ({m['a2a_small_bytes']} B "
        f"sent/rank), large {m['a2a_large_s'] * 1e3:7.2f} ms ({m['a2a_large_bytes'] / 2**20:.1f}"
        f" MiB) -> {cal['a2a_bw'] / 1e9:.3f} GB/s per rank, latency "
        f"{cal['a2a_lat_s'] * 1e3:.3f} ms",
        f"P2P ring step      small {m['p2p_small_s'] * 1e3:7.3f} ms ({m['p2p_small_bytes']} B), "
        f"large {m['p2p_large_s'] * 1e3:7.2f} ms ({m['p2p_large_bytes'] / 2**20:.1f} MiB) -> "
        f"{cal['p2p_bw'] / 1e9:.3f} GB/s per rank, latency {cal['p2p_lat_s'] * 1e3:.3f} ms",
        f"LSE merge          {m['merge_s'] * 1e3:.2f} ms for [1, 2048, 8, 64] -> "
        f"{cal['merge_bw'] / 1e9:.2f} GB/s as the model counts it (3 fp32 passes)",
        f"attention kernel   [1, {PROBE[0]}, {PROBE[1]}, 64] causal fp32, all ranks at once: "
        f"fwd {m['kernel_fwd_s'] * 1e3:.1f} ms, fwd+bwd {m['kernel_fb_s'] * 1e3:.1f} ms -> "
        f"{cal['kernel_flops'] / 1e9:.2f} GFLOP/s per rank (fwd alone "
        f"{cal['kernel_fwd_flops'] / 1e9:.2f}); bwd/fwd time {cal['bwd_over_fwd']:.2f} "
        f"(model FLASH_BWD {FLASH_BWD})",
        f"                   [1, {PROBE_NC[0]}, {PROBE_NC[1]}, 64] non-causal fwd+bwd "
        f"{m['kernel_nc_s'] * 1e3:.1f} ms -> {cal['kernel_nc_flops'] / 1e9:.2f} GFLOP/s; "
        f"causal diagonal waste = {cal['causal_tile']:.0f} tokens",
        f"overlap            kernel {m['ovl_kernel_s'] * 1e3:.1f} ms, transfer "
        f"{m['ovl_comm_s'] * 1e3:.1f} ms, both {m['ovl_both_s'] * 1e3:.1f} ms -> "
        f"{cal['overlap']:.0%} of the shorter one hidden (median of paired repetitions; "
        f"the model assumes 100%)",
        "\nconfigs/cluster/cpu_local.yaml (measured fields; mfu = causal kernel rate / "
        "peak_flops):",
        yaml_lines(ev["spec"]),
        f"\n== attention fwd+bwd: B={setup.batch} H={setup.heads}/{setup.kv_heads} "
        f"d={setup.head_dim} causal fp32 {setup.balance}; {stat} of {setup.iters} rounds, "
        f"slowest rank; model on the calibrated spec, {setup.nprocs} ranks on one host ==",
        "meas = usp_attention; compute = the same ring, no transfers, no all-to-all; "
        "rest = meas - compute;\npred = usp.planner.cost.attention_cost (compute = FLOPs + "
        "merges, comm = all-to-all + exposed ring); proto = the same with the measured "
        "overlap and causal_tile",
    ]
    head = (f"{'L':>5} {'config':<9} {'meas ms':>8} {'compute':>8} {'rest':>7} | {'pred ms':>8} "
            f"{'compute':>8} {'comm':>6} | {'pred/meas':>9} {'compute':>7} {'comm':>6} | "
            f"{'proto ms':>8} {'/meas':>6}")
    out += [head, "-" * len(head)]
    for o in ev["orders"]:
        for row in (x for x in ev["rows"] if x["L"] == o["L"]):
            rest = row["rest_s"]
            out.append(
                f"{o['L']:>5} {row['config']:<9} {row['measured_s'] * 1e3:8.1f} "
                f"{row['compute_s'] * 1e3:8.1f} {rest * 1e3:7.1f} | {row['pred_s'] * 1e3:8.1f} "
                f"{row['pred_compute_s'] * 1e3:8.1f} {row['pred_comm_s'] * 1e3:6.1f} | "
                f"{row['pred_s'] / row['measured_s']:9.3f} "
                f"{row['pred_compute_s'] / row['compute_s']:7.3f} "
                f"{row['pred_comm_s'] / rest if rest > 0 else float('nan'):6.2f} | "
                f"{row['proto_s'] * 1e3:8.1f} {row['proto_s'] / row['measured_s']:6.3f}")
        mo, po, qo = o["measured"], o["predicted"], o["proto"]
        out += [f"{'':>5} order: measured {' < '.join(mo)} | compute-only "
                f"{' < '.join(o['compute_only'])}",
                f"{'':>5}        model    {' < '.join(po)} ({'same' if mo == po else 'differs'})"
                f" | proto {' < '.join(qo)} ({'same' if mo == qo else 'differs'})",
                f"{'':>5} pairs with the same winner in every round: {o['resolved']}/{o['pairs']};"
                f" model agrees on {o['agree']}/{o['resolved']}, proto on "
                f"{o['proto_agree']}/{o['resolved']}"]
    out += [""] + summary_lines(ev) + summary_lines(other)
    plain = {e["stat"]: dict(e, spec=asdict(e["spec"])) for e in (ev, other)}
    return "\n".join(out), plain
