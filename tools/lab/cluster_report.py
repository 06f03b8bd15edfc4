"""Tables, PNGs and the planner's verdict from the simulated-cluster measurements.

``report`` needs no root and no processes: it reads what ``tools.lab.cluster_worker``
measured (``worker``), the ``usp-train`` step times (``train``) and writes ``tables.txt``
and one PNG per benchmark into ``out``.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from usp.config import ModelConfig
from usp.planner import BatchSpec, CheckpointPolicy, Search, StepPolicy, plan
from usp.config.cluster import ClusterSpec, load_cluster
from usp.planner.calibration import fit_a2a_overlap
from usp.planner.cost import attention_cost, best_a2a_chunks, estimate
from .cluster_bench import NODES, PER_NODE, WORLD, ClusterBench, chunk_layouts
from .plots import bar_png, grouped_bar_png

RINGS = ("ring P=2 zigzag", "ring P=2 contiguous")
RING_WHOLE = "ring P=2 zigzag whole"
SWEEP = {(4, 1): "(4,1)", (2, 2): "(2,2) ulysses_inner", (1, 4): "(1,4)"}  # (b)


def table(title: str, head: list[str], rows: list[list]) -> list[str]:
    """A right-aligned text table under a title line (and a blank line before it)."""
    widths = [max(len(str(h)), *(len(str(r[i])) for r in rows)) for i, h in enumerate(head)]
    out = ["", title, "  ".join(f"{h:>{w}}" for h, w in zip(head, widths)),
           "  ".join("-" * w for w in widths)]
    return out + ["  ".join(f"{str(c):>{w}}" for c, w in zip(r, widths)) for r in rows]


def medians(times: dict) -> dict:
    """{name: [ms, ...]} -> {name: median ms}."""
    return {k: statistics.median(v) for k, v in times.items()}


def placement_ratio(ms: dict) -> tuple[float, float, float]:
    """(2,2) attention ms with ulysses inside nodes, across nodes, and across / inside."""
    a_in, a_out = ms["(2,2) ulysses_inner"], ms["(2,2) ring_inner"]
    return a_in, a_out, a_out / a_in


def _links(w: dict, lines: list[str]) -> None:
    lk = w["links"]
    lines.append(f"hosts seen by the ranks: {w['hosts']}")
    lines += table("links (gloo send/recv, best of 3)", ["link", "MB/s", "ratio"],
                   [["intra-node (loopback)", f"{lk['intra'] / 1e6:.0f}", "1.00"],
                    ["inter-node (veth+tbf)", f"{lk['inter'] / 1e6:.0f}",
                     f"{lk['intra'] / lk['inter']:.2f}x slower"]])


def _placement(cfg: ClusterBench, ms: dict, train: dict, out: Path, lines: list[str]) -> dict:
    a_in, a_out, ratio = placement_ratio(ms)
    t_in, t_out = train["(2,2) ulysses_inner"], train["(2,2) ring_inner"]
    lines += table(f"(a) placement, (u,r)=(2,2): attention fwd+bwd L={cfg.seq_len} (median ms, "
                   f"max over ranks) and usp-train step (median s)",
                   ["placement", "attn ms", "train step s"],
                   [["ulysses inside nodes", f"{a_in:.1f}", f"{t_in:.3f}"],
                    ["ulysses across nodes", f"{a_out:.1f}", f"{t_out:.3f}"],
                    ["across / inside", f"{ratio:.2f}x", f"{t_out / t_in:.2f}x"]])
    bar_png(out / "a_placement.png", f"(a) (2,2) placement, attention L={cfg.seq_len}",
            ["ulysses inner", "ring inner"], [a_in, a_out], "fwd+bwd ms")
    return dict(attn_ratio=ratio, train_ratio=t_out / t_in)


def _bytes(cfg: ClusterBench, sent: dict, out: Path, lines: list[str]) -> float:
    rows = [[name, b["ulysses"], b["ring"], b["measured"], b["formula"],
             f"{(b['measured'] / b['formula'] - 1) * 100:+.2f}%",
             b["hosts_per_ulysses_group"], b["hosts_per_ring_group"]] for name, b in sent.items()]
    lines += table(f"(e) bytes sent per rank per attention layer (fwd+bwd, fp32, B=1 "
                   f"L={cfg.seq_len} Hq={cfg.heads} Hkv={cfg.kv_heads} d={cfg.head_dim})",
                   ["config", "ulysses B", "ring B", "measured B", "formula B", "diff",
                    "hosts/uly grp", "hosts/ring grp"], rows)
    names = list(sent)
    bar_png(out / "e_bytes.png", "(e) bytes per rank per layer", names,
            [sent[n]["measured"] / 1e6 for n in names], "MB",
            ref=[sent[n]["formula"] / 1e6 for n in names], ref_label="formula")
    return max(abs(b["measured"] / b["formula"] - 1) for b in sent.values())


def _activations(cfg: ClusterBench, saved: dict, out: Path, lines: list[str]) -> dict:
    sb = {int(k): v for k, v in saved.items()}
    ps = sorted(sb)
    mib = 2**20
    lines += table(f"(d) tensors saved for backward per rank, tiny model, L={cfg.mem_seq_len}",
                   ["P", "MiB/rank", "single/P MiB", "ratio"],
                   [[P, f"{sb[P] / mib:.2f}", f"{sb[1] / P / mib:.2f}",
                     f"{sb[P] / (sb[1] / P):.3f}"] for P in ps])
    bar_png(out / "d_activation_memory.png", f"(d) saved activations per rank "
            f"L={cfg.mem_seq_len}", [f"P={P}" for P in ps], [sb[P] / mib for P in ps], "MiB",
            ref=[sb[1] / P / mib for P in ps], ref_label="single / P")
    return {P: sb[P] / (sb[1] / P) for P in ps}


def ring_efficiency(cfg: ClusterBench, w: dict, ms: dict | None, out: Path,
                    lines: list[str]) -> dict:
    """(c): one rank per core (the ``ring`` phase) and, given the main phase's ``ms``, 4
    ranks on the host's 2 cores. The ring phase also has zigzag with whole messages
    (``RING_WHOLE``, pieces being the default across hosts): a column when present."""
    setups = [("1 rank per core", medians(by_name), int(n_tok))
              for n_tok, by_name in (w.get("ring") or {}).items()]
    if ms is not None:
        setups.append(("4 ranks on 2 cores", ms, cfg.seq_len))
    rows, eff = [], {}
    for setup, t, n_tok in setups:
        ideal = t["dense P=1"] / 2
        names = [n for n in (*RINGS, RING_WHOLE) if n in t]
        rows.append([setup, n_tok, f"{t['dense P=1']:.1f}", f"{ideal:.1f}"]
                    + [f"{t[n]:.1f} ({ideal / t[n] * 100:.0f}%)" if n in t else "-"
                       for n in (*RINGS, RING_WHOLE)])
        eff[f"{setup}, L={n_tok}"] = {n: ideal / t[n] for n in names}
    lines += table("(c) ring at P=2 across nodes vs the ideal dense / 2, attention fwd+bwd "
                   "(median ms, efficiency); messages in pieces across hosts except in the "
                   "last column",
                   ["setup", "L", "dense P=1", "ideal = dense/2", "zigzag", "contiguous",
                    "zigzag, whole messages"], rows)
    grouped_bar_png(
        out / "c_ring_efficiency.png", [f"L={n_tok}\n{setup}" for setup, _, n_tok in setups],
        [(n.split()[-1], [eff[f"{s}, L={n_tok}"][n] * 100 for s, _, n_tok in setups])
         for n in RINGS],
        "% of ideal (dense / 2)", title="(c) ring P=2 efficiency", hline=(90, "90%"),
        width=6.5, tick_size=7)
    return eff


def planner_spec(cfg: ClusterBench, w: dict, ms: dict, per_node: int = PER_NODE
                 ) -> ClusterSpec:
    """The planner's ClusterSpec of the simulated cluster of ``per_node`` ranks per node,
    every figure measured: link rates, one shared link of each kind per node (a node's
    ranks share its veth and its loopback), the dense attention's FLOP/s at mfu 1 (causal
    fwd 2 L^2 Hq d, backward 2.5x that; timed on every rank at once, so with the cores
    shared as they are in the layouts), the overlap of a cross-node transfer with a kernel
    and the latency of a small message on each link (``cluster_worker.measure_latency``);
    cpu_local's overlap and latencies where they were not measured."""
    base, L = load_cluster("cpu_local"), cfg.seq_len
    flops = 3.5 * 2 * L * L * cfg.heads * cfg.head_dim / (ms["dense P=1"] / 1e3)
    overlap = w["overlap"]["share"] if "overlap" in w else base.overlap
    lat = w.get("latency", {"intra": base.intra_latency_s, "inter": base.inter_latency_s})
    return base.replace(name="simcluster", ranks_per_node=per_node, nodes=NODES,
                        intra_bw=w["links"]["intra"], inter_bw=w["links"]["inter"],
                        intra_latency_s=lat["intra"], inter_latency_s=lat["inter"],
                        peak_flops=flops, mfu=1.0, overlap=overlap,
                        gpus_per_nic=per_node, gpus_per_intra_link=per_node)


def _spec_lines(spec: ClusterSpec, w: dict, lines: list[str]) -> None:
    lines.append(f"planner spec: intra {spec.intra_bw / 1e6:.0f} MB/s, inter "
                 f"{spec.inter_bw / 1e6:.0f} MB/s, one of each per node; latency intra "
                 f"{spec.intra_latency_s * 1e3:.2f} ms, inter {spec.inter_latency_s * 1e3:.2f} "
                 f"ms; {spec.peak_flops / 1e9:.1f} GFLOP/s per rank; overlap "
                 f"{spec.overlap:.2f} ({'all' if 'latency' in w else 'latency not'} measured)")
    if "overlap" in w:
        o = w["overlap"]
        lines.append(f"overlap test: kernel {o['kernel_ms']:.1f} ms, cross-node transfer "
                     f"{o['transfer_ms']:.1f} ms, both {o['both_ms']:.1f} ms -> {o['share']:.0%} "
                     f"of the shorter hidden (median of paired repetitions)")


def _degrees(cfg: ClusterBench, w: dict, ms: dict, train: dict, out: Path,
             lines: list[str]) -> dict:
    spec = planner_spec(cfg, w, ms)
    _spec_lines(spec, w, lines)
    p = plan(ModelConfig(), spec, cfg.train_seq_len, world=WORLD, search=Search(dp=1),
             batch=BatchSpec(global_batch=cfg.train_batch),
             step=StepPolicy(dtype_bytes=4, checkpoint=CheckpointPolicy()))
    pred = {(c.ulysses, c.ring): c.cost.step_s for c in p.candidates}
    measured = {k: train[v] for k, v in SWEEP.items()}
    rank_m = sorted(measured, key=measured.get)
    rank_p = sorted((k for k in SWEEP if k in pred), key=pred.get)
    rows = [[f"({u},{r})", f"{ms[SWEEP[(u, r)]]:.1f}", f"{measured[(u, r)]:.3f}",
             rank_m.index((u, r)) + 1,
             f"{pred[(u, r)]:.3f}" if (u, r) in pred else "dropped",
             rank_p.index((u, r)) + 1 if (u, r) in pred else "-"] for (u, r) in SWEEP]
    lines += table(f"(b) degree sweep at world {WORLD}: attention L={cfg.seq_len} and usp-train "
                   f"step (L={cfg.train_seq_len}, batch {cfg.train_batch}) vs planner "
                   f"(measured links)",
                   ["(u,r)", "attn ms", "train s", "measured rank", "planner s", "planner rank"],
                   rows)
    choice, best = rank_p[0], rank_m[0]
    gap = measured[choice] / measured[best] - 1
    lines.append(f"planner choice {choice}: measured {gap * 100:+.1f}% vs best {best}")
    bar_png(out / "b_degree_sweep.png", "(b) usp-train step vs planner", list(SWEEP.values()),
            [measured[k] for k in SWEEP], "step s",
            ref=[pred.get(k, float("nan")) for k in SWEEP], ref_label="planner")
    return dict(choice=list(choice), best=list(best), gap=gap)


CHUNK_TOL = 0.05  # the planner's count is "right" within 5% of the measured best
GAIN_TOL = 0.10  # a predicted gain "holds" within 10% of the measured one


def chunk_spec(cfg: ClusterBench, w: dict, per_node: int = PER_NODE
               ) -> tuple[ClusterSpec, str]:
    """(``planner_spec`` with ``a2a_overlap`` fitted, how): the share whose predicted
    attention gains miss the measured ones of every (f) layout and count of the cluster
    by the least (``fit_a2a_overlap``)."""
    spec = planner_spec(cfg, w, medians(w["attention_ms"]), per_node)
    cases = []
    for name, u, r, pl, _ in chunk_layouts(per_node):
        one = w["attention_ms"][f"{name} c=1"]
        for c in cfg.legal_chunks(u)[1:]:
            gain = statistics.median(a / b for a, b in zip(
                one, w["attention_ms"][f"{name} c={c}"], strict=True))
            cases.append((gain, dict(seq_len=cfg.seq_len, hq=cfg.heads, hkv=cfg.kv_heads,
                                     head_dim=cfg.head_dim, ulysses=u, ring=r, dtype_bytes=4,
                                     placement=pl, a2a_chunks=c)))
    share = fit_a2a_overlap(spec, cases)
    return (spec.replace(a2a_overlap=share),
            f"a2a_overlap {share:.3f}, fitted to the {len(cases)} measured gains below "
            f"(the least worst error)")


def chunk_verdict(measured: dict, predicted: dict, choice: int) -> dict:
    """Pipelined all-to-all of one layout: ``measured`` {a2a_chunks: [s per round]} (every
    count timed in the same rounds), ``predicted`` {a2a_chunks: s}, the planner's
    ``choice``. A measured gain is the median over rounds of time at 1 stage / time at c
    stages (paired: load that drifts between rounds cancels); the best count has the
    highest gain (the fewest stages on a tie); ``gap`` = best's gain / choice's - 1."""
    gain = {c: statistics.median(a / b for a, b in zip(measured[1], t, strict=True))
            for c, t in measured.items()}
    best = max(gain, key=lambda c: (gain[c], -c))
    gap = gain[best] / gain[choice] - 1
    pred = {c: predicted[1] / t for c, t in predicted.items()}
    off = max(abs(pred[c] / gain[c] - 1) for c in gain)
    return dict(gain=gain, predicted_gain=pred, choice=choice, best=best, gap=gap,
                within=gap <= CHUNK_TOL, prediction_off=off, prediction_holds=off <= GAIN_TOL)


SPLIT_COLUMNS = ["a2a exposed ms", "a2a hidden ms", "ring exposed ms"]


def chunk_lines(title: str, unit: str, by_layout: dict,
                extra: tuple[list[str], dict] | None = None) -> list[str]:
    """A table (one row per layout and a2a_chunks: median time, gains) and one verdict line
    per layout. ``by_layout``: {layout: (measured {c: [s per round]}, chunk_verdict)};
    ``extra``: (column names, {layout: {c: [cells]}}) appended to each row (the
    all-to-all split, the step's communication share)."""
    head = ["layout", "a2a_chunks", unit, "measured gain", "predicted gain", "planner"]
    if extra:
        head += extra[0]
    rows, verdicts = [], []
    for name, (t, v) in by_layout.items():
        for c in sorted(t):
            scale = 1e3 if unit.endswith("ms") else 1.0
            rows.append([name, c, f"{statistics.median(t[c]) * scale:.3f}",
                         f"{v['gain'][c]:.2f}x", f"{v['predicted_gain'][c]:.2f}x",
                         "<- choice" if c == v["choice"] else ""]
                        + (extra[1][name][c] if extra else []))
        verdicts.append(f"{name}: planner a2a_chunks={v['choice']}, measured best "
                        f"{v['best']}: {v['gap'] * 100:+.1f}% (within {CHUNK_TOL:.0%}: "
                        f"{'yes' if v['within'] else 'no'}); predicted gains off by at most "
                        f"{v['prediction_off']:.1%} (a2a_overlap fitted to these gains; within "
                        f"{GAIN_TOL:.0%}: "
                        f"{'yes' if v['prediction_holds'] else 'no'})")
    return table(title, head, rows) + verdicts


def chunk_picks(cfg: ClusterBench, w: dict, per_node: int = PER_NODE) -> dict:
    """{layout: {"attention": c, "train": c}} for the layouts of the cluster with
    ``per_node`` ranks per node: ``best_a2a_chunks`` on the spec of ``w``'s measurements
    (``chunk_spec``) for the attention benchmark and for the usp-train runs."""
    spec = chunk_spec(cfg, w, per_node)[0]
    heads = (cfg.heads, cfg.kv_heads, cfg.head_dim)
    return {name: {k: best_a2a_chunks(spec, L, *heads, u, r, dtype_bytes=4, placement=pl)
                   for k, L in (("attention", cfg.seq_len), ("train", cfg.train_seq_len))}
            for name, u, r, pl, _ in chunk_layouts(per_node)}


def _chunks(cfg: ClusterBench, w: dict, out: Path, lines: list[str]) -> dict:
    """(f) from the ``chunks`` phase (``w``, with its usp-train steps under ``"train"`` and
    their attention-communication shares under ``"train_share"``), and from the 2 x 1
    cluster's under ``w["solo"]`` when it ran."""
    heads = (cfg.heads, cfg.kv_heads, cfg.head_dim)
    model = ModelConfig(dim=cfg.heads * cfg.head_dim, n_heads=cfg.heads, n_kv_heads=cfg.kv_heads)
    attn, step, split, share, summary = {}, {}, {}, {}, {}
    for part, per_node in ((w, PER_NODE), (w.get("solo"), 1)):
        if part is None:
            continue
        spec, fitted = chunk_spec(cfg, part, per_node)
        if per_node == PER_NODE:
            _spec_lines(spec, part, lines)
        else:
            lines.append(f"2 x 1 cluster (one rank per core): {spec.peak_flops / 1e9:.1f} "
                         f"GFLOP/s per rank; links, latency and overlap as above")
        lines.append(f"{NODES} x {per_node} cluster: {fitted}")
        picks = chunk_picks(cfg, part, per_node)
        for name, u, r, pl, _ in chunk_layouts(per_node):
            t = {c: [x / 1e3 for x in part["attention_ms"][f"{name} c={c}"]]
                 for c in cfg.legal_chunks(u)}
            pred = {c: attention_cost(spec, cfg.seq_len, *heads, u, r, dtype_bytes=4,
                                      placement=pl, a2a_chunks=c).total_s for c in t}
            attn[name] = t, chunk_verdict(t, pred, picks[name]["attention"])
            split[name] = {c: [f"{x:.1f}" for x in part["split"][f"{name} c={c}"].values()]
                           for c in t}
            summary[name] = {"attention": attn[name][1]}
            st = {int(c): passes for c, passes in part.get("train", {}).get(name, {}).items()}
            if 1 in st and picks[name]["train"] in st:
                pred = {c: estimate(model, spec, cfg.train_seq_len, 1, r, u, placement=pl,
                                    global_batch=cfg.train_batch, dtype_bytes=4,
                                    act_checkpoint=False, a2a_chunks=c).step_s for c in st}
                step[name] = st, chunk_verdict(st, pred, picks[name]["train"])
                summary[name]["train"] = step[name][1]
                shares = part.get("train_share", {}).get(name, {})
                share[name] = {c: [f"{statistics.median(shares[str(c)]):.1%}"
                                   if str(c) in shares else "-"] for c in st}
    lines += chunk_lines(f"(f) pipelined all-to-all across nodes: attention fwd+bwd "
                         f"L={cfg.seq_len} (median ms of {cfg.iters} rounds, max over ranks); "
                         f"gain = median over rounds of time at a2a_chunks=1 / time; "
                         f"split per call, mean over ranks",
                         "attn ms", attn, (SPLIT_COLUMNS, split))
    if step:
        lines += chunk_lines(f"(f) usp-train step, L={cfg.train_seq_len} batch "
                             f"{cfg.train_batch}, model {' '.join(cfg.train_model())}: median "
                             f"step s over {cfg.train_passes} passes, gain paired by pass; "
                             f"attention comm: the step's share blocked in attention "
                             f"communication (median over passes)",
                             "train step s", step, (["attention comm"], share))
    labels = [f"{n} c={c}" for n, (t, _) in attn.items() for c in sorted(t)]
    bar_png(out / "f_a2a_chunks.png", "(f) attention gain of a2a_chunks", labels,
            [v["gain"][c] for _, (t, v) in attn.items() for c in sorted(t)], "x vs chunks=1",
            ref=[v["predicted_gain"][c] for _, (t, v) in attn.items() for c in sorted(t)],
            ref_label="planner")
    return summary


def report(cfg: ClusterBench, w: dict, train: dict, out: Path) -> tuple[dict, list[str]]:
    """(summary, text lines) of one run; writes ``out/tables.txt`` and the PNGs. ``cfg``:
    the run's ``ClusterBench``; ``w``: ``worker.json`` with the ``ring`` phase's result
    under ``"ring"`` and the ``chunks`` phase's (if run) under ``"chunks"``; ``train``:
    {case name: median usp-train step s}. A run of (f) alone has only ``"chunks"``."""
    lines: list[str] = []
    summary: dict = {}
    if "attention_ms" in w:
        ms = medians(w["attention_ms"])
        _links(w, lines)
        summary = {"links": w["links"],
                   "placement": _placement(cfg, ms, train, out, lines),
                   "bytes_max_rel_err": _bytes(cfg, w["bytes"], out, lines),
                   "act_ratio": _activations(cfg, w["saved_bytes"], out, lines),
                   "ring_eff": ring_efficiency(cfg, w, ms, out, lines),
                   "planner": _degrees(cfg, w, ms, train, out, lines)}
    if "chunks" in w:
        if "attention_ms" not in w:
            _links(w["chunks"], lines)
        summary["chunks"] = _chunks(cfg, w["chunks"], out, lines)
    (out / "tables.txt").write_text("\n".join(lines) + "\n")
    return summary, lines


def placement_report(cfg: ClusterBench, runs: list[tuple[str, str | None, dict]],
                     out: Path) -> list[str]:
    """The placement sweep's table (also ``out/placement_sweep.txt``) and PNG; ``runs``:
    one (inter rate, intra rate or None for loopback, worker.json) per rate pair."""
    rows, inside, across = [], [], []
    for inter, intra, w in runs:
        lk = w["links"]
        a_in, a_out, ratio = placement_ratio(medians(w["attention_ms"]))
        rows.append([inter, intra or "loopback", f"{lk['inter'] / 1e6:.0f}",
                     f"{lk['intra'] / 1e6:.0f}", f"{lk['intra'] / lk['inter']:.1f}",
                     f"{a_in:.1f}", f"{a_out:.1f}", f"{ratio:.2f}x"])
        inside.append(a_in)
        across.append(a_out)
    lines = table(f"(a) placement sweep, (u,r)=(2,2), attention fwd+bwd L={cfg.seq_len} "
                  f"Hq={cfg.heads} Hkv={cfg.kv_heads} (median ms, max over ranks)",
                  ["inter rate", "intra rate", "inter MB/s", "intra MB/s", "intra/inter",
                   "ulysses inside ms", "ulysses across ms", "across/inside"], rows)
    (out / "placement_sweep.txt").write_text("\n".join(lines) + "\n")
    grouped_bar_png(out / "a_placement_sweep.png", [r[0] for r in runs],
                    [("ulysses inside nodes", inside), ("ulysses across nodes", across)],
                    "attention fwd+bwd ms", xlabel="inter-node rate")
    return lines
