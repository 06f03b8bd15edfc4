"""usp on a simulated 2-node x 2-rank cluster (``tools.lab.simcluster``): the multi-node benchmarks.

``run`` (needs root) builds one ``SimCluster`` and runs

1. ``tools.lab.cluster_worker`` (phase ``main``), which measures the links (gloo
   send/recv rank 0 -> 1, same node, and 0 -> 2, other node); (a) attention fwd+bwd at
   (u, r) = (2, 2), ulysses inside vs across nodes; (b) attention at (4, 1), (2, 2),
   (1, 4); (c) the ring alone at P=2 across nodes, zigzag vs contiguous, against the
   ideal dense time / 2; the overlap share of a cross-node transfer with a kernel; (e)
   bytes sent per rank per attention layer against ``usp.planner.traffic.attention_bytes``;
   (d) bytes saved for backward per rank at P = 1, 2, 4 against the single-process value / P;
2. ``usp-train`` runs of ``train_steps`` steps for (a) both placements and (b) the three
   degrees: median ``step_s`` (first step dropped), ``train_passes`` runs per case in
   alternating order, the lowest median kept, beside the planner's ranking on a
   ClusterSpec made of the measured figures (``cluster_report.planner_spec``);
3. (c) once more on a 2-node x 1-rank cluster at the same rates (phase ``ring``): one
   process per core, so a waiting rank idles its core the way a waiting GPU idles;
4. with ``a2a_chunks`` (or ``only_chunks``): (f) the pipelined all-to-all
   (``measure_chunks``), the ulysses group across the link, on 2 x 2 at (4,1) and (2,2)
   ``ring_inner`` and on 2 x 1 at (2,1): attention at every legal count, usp-train at
   the asked ones.

``report`` (``tools.lab.cluster_report``) turns the results into tables and PNGs;
everything is saved to ``OUT/results.json``.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from pathlib import Path

from .cluster_bench import CHUNK_LAYOUTS, NODES, PER_NODE, TRAIN_CASES, ClusterBench
from .cluster_report import (chunk_picks, medians, placement_ratio, placement_report,
                             report, ring_efficiency)
from .cluster_worker import result_file
from .simcluster import SimCluster, say

def run_phase(cluster: SimCluster, cfg: ClusterBench, phase: str, echo: bool = True) -> dict:
    """Run ``tools.lab.cluster_worker`` on every rank of ``cluster``; rank 0's result."""
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg.save(out / "bench.json")
    r = cluster.run(["-m", "tools.lab.cluster_worker", str(out / "bench.json"), phase],
                    timeout=900, echo=echo)
    if r.returncode:
        raise RuntimeError(f"bench_cluster: worker phase {phase} failed ({r.returncode}):\n"
                           f"{r.output[-3000:]}")

    return json.loads((out / result_file(phase)).read_text())


def train_step_s(cluster: SimCluster, cfg: ClusterBench, tag: str, overrides: list[str]
                 ) -> dict:
    """A ``usp-train`` run on ``cluster``, medians over its steps (the first dropped):
    ``step_s`` and ``attn_comm_share`` (the step's share blocked in attention
    communication, ulysses and ring)."""
    run_dir = Path(cfg.out) / f"train_{tag}"
    cmd = ["-m", "usp.cli", *overrides, "parallel.ranks_per_node=null",
           f"data.seq_len={cfg.train_seq_len}", f"data.batch_per_dp_rank={cfg.train_batch}",
           f"trainer.steps={cfg.train_steps}", "data.eval_batches=0", "logging.wandb=disabled",
           "logging.plot=false", "logging.progress=false", f"trainer.run_dir={run_dir}",
           f"hydra.run.dir={run_dir}", "trainer.resume=false"]
    r = cluster.run(cmd, echo=False, timeout=600)
    if r.returncode:
        raise RuntimeError(f"bench_cluster: training {tag} failed ({r.returncode}):\n"
                           f"{r.output[-3000:]}")
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x]
    steps = [row for row in rows if "step_s" in row][1:]
    return {k: statistics.median(row[k] for row in steps) for k in ("step_s", "attn_comm_share")}


def _alternating(cluster: SimCluster, cfg: ClusterBench, cases: list, log) -> dict:
    """{key: [``train_step_s`` of each pass]} of ``cases`` = [(key, label, tag, usp-train
    overrides)] over ``train_passes`` passes, the order reversed every other pass so that
    drift hits every case alike."""
    steps: dict = {}
    for pas in range(cfg.train_passes):
        for key, label, tag, overrides in cases if pas % 2 == 0 else cases[::-1]:
            got = train_step_s(cluster, cfg, f"{tag}_p{pas}", overrides)
            log(f"usp-train {label} pass {pas}: median step {got['step_s']:.3f} s, attention "
                f"comm {got['attn_comm_share']:.1%} of it")
            steps.setdefault(key, []).append(got)
    return steps


def train_all(cluster: SimCluster, cfg: ClusterBench, log: Callable[[str], None]) -> dict:
    """{case name: lowest median step s over the passes} of ``TRAIN_CASES``."""
    steps = _alternating(cluster, cfg, [
        (name, name, f"{u}x{r}_{pl}", [f"parallel.ulysses_degree={u}",
                                       f"parallel.ring_degree={r}", f"parallel.placement={pl}"])
        for name, u, r, pl in TRAIN_CASES], log)
    return {name: min(p["step_s"] for p in passes) for name, passes in steps.items()}


def chunk_train_counts(cfg: ClusterBench, picks: dict) -> dict:
    """{layout name: the a2a_chunks its usp-train runs take} for the layouts in ``picks``:
    ``cfg.a2a_chunks`` legal for the layout, ``auto`` replaced by ``picks[layout]`` (the
    planner's count)."""
    return {name: sorted({picks[name] if c == "auto" else c for c in cfg.a2a_chunks}
                         & set(cfg.legal_chunks(u))) for name, u, *_ in CHUNK_LAYOUTS
            if name in picks}


def train_chunks(cluster: SimCluster, cfg: ClusterBench, counts: dict,
                 log: Callable[[str], None]) -> dict:
    """(f): {layout name: {a2a_chunks: [``train_step_s`` per pass]}} of usp-train with the
    benchmark's heads (``train_model``), every layout in ``counts`` at its counts."""
    cases = [((name, c), f"{name} a2a_chunks={c}", f"chunks_{u}x{r}_{pl}_n{n}_c{c}",
              [*cfg.train_model(), f"parallel.ulysses_degree={u}", f"parallel.ring_degree={r}",
               f"parallel.placement={pl}", f"parallel.a2a_chunks={c}"])
             for name, u, r, pl, n in CHUNK_LAYOUTS if name in counts for c in counts[name]]
    steps = _alternating(cluster, cfg, cases, log)
    return {name: {c: steps[(name, c)] for c in cs} for name, cs in counts.items()}


def measure_chunks(cluster: SimCluster, cfg: ClusterBench, log: Callable[[str], None],
                   per_node: int = PER_NODE, base: dict | None = None) -> dict:
    """(f) on a started 2-node cluster of ``per_node`` ranks per node: the worker phase
    (``chunks``, or ``chunks_solo`` on 2 x 1, which takes the links, latency and overlap
    of ``base``, the 2 x 2 phase's result), the planner's counts on a spec of the
    measurements, and usp-train at ``cfg.a2a_chunks`` (none when empty): ``train`` holds
    the step s and ``train_share`` the attention-communication share per pass."""

    w = run_phase(cluster, cfg, "chunks" if per_node == PER_NODE else "chunks_solo")
    if base is not None:
        w.update({k: base[k] for k in ("links", "latency", "overlap") if k in base})
    picks = chunk_picks(cfg, w, per_node)
    log(f"planner a2a_chunks (attention, training): {picks}")
    counts = chunk_train_counts(cfg, {k: v["train"] for k, v in picks.items()})
    runs = train_chunks(cluster, cfg, counts, log)
    for key, field in (("train", "step_s"), ("train_share", "attn_comm_share")):
        w[key] = {name: {str(c): [p[field] for p in passes] for c, passes in by_c.items()}
                  for name, by_c in runs.items()}
    return w


def run(cfg: ClusterBench, log: Callable[[str], None] = say, only_chunks: bool = False
        ) -> tuple[dict, list[str]]:
    """Every benchmark (needs root), (f) too when ``cfg.a2a_chunks`` is set; with
    ``only_chunks`` (f) alone (its usp-train runs only at ``cfg.a2a_chunks``). Writes
    ``results.json``, ``tables.txt`` and the PNGs into ``cfg.out`` and returns
    ``report``'s (summary, text lines)."""

    out = Path(cfg.out).resolve()
    cfg = cfg.replace(out=str(out))
    w, train = {}, {}
    with SimCluster(NODES, PER_NODE, rate=cfg.rate, ratio=cfg.ratio, intra_rate=cfg.intra_rate,
                    queue_ms=cfg.queue_ms, log=log) as cluster:
        if not only_chunks:
            w = run_phase(cluster, cfg, "main")
            train = train_all(cluster, cfg, log)
        chunks = bool(cfg.a2a_chunks or only_chunks)
        if chunks:
            w["chunks"] = measure_chunks(cluster, cfg, log)
        rate, intra_rate = cluster.rate, cluster.intra_rate  # "auto" resolved
    with SimCluster(NODES, 1, rate=rate, intra_rate=intra_rate, log=log,
                    queue_ms=cfg.queue_ms) as cluster:
        if not only_chunks:
            w["ring"] = run_phase(cluster, cfg, "ring")
        if chunks:
            w["chunks"]["solo"] = measure_chunks(cluster, cfg, log, 1, base=w["chunks"])
    log(f"simulated cluster: {NODES} nodes x {PER_NODE} ranks, inter-node rate {rate}")
    summary, lines = report(cfg, w, train, out)
    summary.update(rate=rate, train=train)
    (out / "results.json").write_text(json.dumps(dict(worker=w, summary=summary), indent=2,
                                                  default=str))
    return summary, lines


def ring_only(cfg: ClusterBench, log: Callable[[str], None] = say) -> list[str]:
    """(c) alone, on 2 nodes x 1 rank (needs root): writes ``ring.json`` and the table into
    ``cfg.out`` and returns the table's lines."""
    out = Path(cfg.out).resolve()
    cfg = cfg.replace(out=str(out))
    with SimCluster(NODES, 1, rate=cfg.rate, ratio=cfg.ratio, intra_rate=cfg.intra_rate,
                    queue_ms=cfg.queue_ms, log=log) as cluster:
        w = {"ring": run_phase(cluster, cfg, "ring")}
        rate = cluster.rate
    lines = [f"simulated cluster: {NODES} nodes x 1 rank, inter-node rate {rate}, queue "
             f"{cfg.queue_ms:g} ms"]
    eff = ring_efficiency(cfg, w, None, out, lines)
    (out / "ring.json").write_text(json.dumps(dict(worker=w, efficiency=eff), indent=2))
    (out / "ring.txt").write_text("\n".join(lines) + "\n")
    return lines


def report_saved(cfg: ClusterBench) -> tuple[dict, list[str]]:
    """``report`` again from ``cfg.out/results.json`` (no root, no processes)."""

    out = Path(cfg.out)
    saved = json.loads((out / "results.json").read_text())
    return report(cfg, saved["worker"], saved["summary"]["train"], out)


def placement_sweep(cfg: ClusterBench, pairs: list[tuple[str, str | None]],
                    log: Callable[[str], None] = say) -> list[str]:
    """(a) attention only, once per (inter rate, intra rate or None) in ``pairs``: where does
    placement matter? Writes ``placement_sweep.txt`` and a PNG; returns the table lines."""

    out, runs = Path(cfg.out).resolve(), []
    subs = [cfg.replace(out=str(out / f"sweep_{inter}_{intra or 'lo'}"), rate=inter,
                        intra_rate=intra) for inter, intra in pairs]  # bad rates raise here
    for (inter, intra), sub in zip(pairs, subs):
        with SimCluster(NODES, PER_NODE, rate=inter, intra_rate=intra, log=log,
                        queue_ms=cfg.queue_ms) as cluster:
            w = run_phase(cluster, sub, "placement", echo=False)
        runs.append((inter, intra, w))
        log(f"done {inter}:{intra or 'loopback'}: across/inside "
            f"{placement_ratio(medians(w['attention_ms']))[2]:.2f}x")
    return placement_report(cfg, runs, out)
