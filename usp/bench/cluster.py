"""usp on a simulated 2-node x 2-rank cluster (``usp.bench.simcluster``): the multi-node benchmarks.

``run`` (needs root) builds one ``SimCluster`` and runs

1. ``usp.bench.cluster_worker`` (phase ``main``), which measures the links (gloo
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
   process per core, so a waiting rank idles its core the way a waiting GPU idles.

``report`` (``usp.bench.cluster_report``) turns the results into tables and PNGs;
everything is saved to ``OUT/results.json``.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..validate import check_heads, check_seq_len
from .simcluster import SimCluster, rate_to_bytes_per_s, say

NODES, PER_NODE = 2, 2
WORLD = NODES * PER_NODE
TRAIN_CASES = (("(2,2) ulysses_inner", 2, 2, "ulysses_inner"),
               ("(2,2) ring_inner", 2, 2, "ring_inner"),
               ("(4,1)", 4, 1, "ulysses_inner"), ("(1,4)", 1, 4, "ulysses_inner"))
DEGREES = ((4, 1), (2, 2), (1, 4), (1, 2))  # every (ulysses, ring) the benchmarks run


@dataclass(frozen=True)
class ClusterBench:
    """Sizes and link rates of the benchmarks; ``out`` holds every file they write.

    ``rate``: inter-node tc rate or ``"auto"`` (loopback gloo / ``ratio``); ``intra_rate``:
    also shape loopback (None: full speed). Attention: one layer [1, ``seq_len``, ``heads``
    (``kv_heads`` for K/V), ``head_dim``] fp32, ``iters`` timed rounds after ``warmup``;
    (d) at ``mem_seq_len``; ``usp-train`` at ``train_seq_len`` x ``train_batch``; (c) on
    one rank per core at each of ``ring_seq_lens``, ``ring_iters`` rounds; the link test
    sends ``link_bytes``."""

    out: str = "runs/bench_cluster"
    rate: str = "auto"
    ratio: float = 9.0
    intra_rate: str | None = None
    seq_len: int = 2048
    heads: int = 8
    kv_heads: int = 2
    head_dim: int = 64
    iters: int = 5
    warmup: int = 1
    mem_seq_len: int = 2048
    train_seq_len: int = 2048
    train_batch: int = 2
    train_steps: int = 6
    train_passes: int = 2
    ring_seq_lens: tuple[int, ...] = (2048, 4096, 8192)
    ring_iters: int = 7
    link_bytes: int = 32 * 2**20

    def __post_init__(self):
        object.__setattr__(self, "ring_seq_lens", tuple(self.ring_seq_lens))
        low = {k: getattr(self, k) for k, lo in (("iters", 1), ("warmup", 0), ("ring_iters", 1),
                                                   ("train_steps", 2), ("train_passes", 1),
                                                   ("train_batch", 1), ("head_dim", 1))
               if getattr(self, k) < lo}
        if low:
            raise ValueError(f"need iters, ring_iters, train_passes, train_batch, head_dim >= 1, "
                             f"warmup >= 0 and train_steps >= 2 (the first step is dropped), "
                             f"got {low}")
        if self.link_bytes < 4 or self.link_bytes % 4:
            raise ValueError(f"link_bytes must be a positive multiple of 4 (fp32), got "
                             f"{self.link_bytes}; e.g. {32 * 2**20}")
        for r in (self.rate, self.intra_rate):
            if r not in ("auto", None):
                rate_to_bytes_per_s(r)
        if not self.ring_seq_lens:
            raise ValueError("ring_seq_lens is empty; give at least one length, e.g. 2048")
        for u in sorted({u for u, _ in DEGREES}):
            check_heads(self.heads, self.kv_heads, u)
        for L in (self.seq_len, self.mem_seq_len, self.train_seq_len):
            for u, r in DEGREES:
                check_seq_len(L, u, r, "zigzag")
        for L in self.ring_seq_lens:
            check_seq_len(L, 1, 2, "zigzag")

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(dataclasses.asdict(self), indent=2))

    @classmethod
    def load(cls, path: Path) -> ClusterBench:
        return cls(**json.loads(Path(path).read_text()))

    def replace(self, **changes) -> ClusterBench:
        return dataclasses.replace(self, **changes)


def run_phase(cluster: SimCluster, cfg: ClusterBench, phase: str, echo: bool = True) -> dict:
    """Run ``usp.bench.cluster_worker`` on every rank of ``cluster``; rank 0's result."""
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg.save(out / "bench.json")
    r = cluster.run(["-m", "usp.bench.cluster_worker", str(out / "bench.json"), phase],
                    timeout=900, echo=echo)
    if r.returncode:
        raise RuntimeError(f"bench_cluster: worker phase {phase} failed ({r.returncode}):\n"
                           f"{r.output[-3000:]}")
    return json.loads((out / ("worker_ring.json" if phase == "ring" else "worker.json"))
                      .read_text())


def train_step_s(cluster: SimCluster, cfg: ClusterBench, tag: str, overrides: list[str]
                 ) -> float:
    """Median ``step_s`` of a ``usp-train`` run on ``cluster`` (its first step dropped)."""
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
    return statistics.median([row["step_s"] for row in rows if "step_s" in row][1:])


def train_all(cluster: SimCluster, cfg: ClusterBench, log: Callable[[str], None]) -> dict:
    """{case name: lowest median step s over ``train_passes`` passes}, order alternating per
    pass so that drift hits every case alike."""
    train: dict[str, float] = {}
    for pas in range(cfg.train_passes):
        for name, u, r, pl in TRAIN_CASES if pas % 2 == 0 else TRAIN_CASES[::-1]:
            tag = f"{u}x{r}_{pl}_p{pas}"
            got = train_step_s(cluster, cfg, tag, [f"parallel.ulysses_degree={u}",
                                                   f"parallel.ring_degree={r}",
                                                   f"parallel.placement={pl}"])
            log(f"usp-train {name} pass {pas}: median step {got:.3f} s")
            train[name] = min(got, train.get(name, got))
    return train


def run(cfg: ClusterBench, log: Callable[[str], None] = say) -> tuple[dict, list[str]]:
    """Every benchmark (needs root); writes ``results.json``, ``tables.txt`` and the PNGs
    into ``cfg.out`` and returns ``report``'s (summary, text lines)."""
    from .cluster_report import report

    out = Path(cfg.out).resolve()
    cfg = cfg.replace(out=str(out))
    with SimCluster(NODES, PER_NODE, rate=cfg.rate, ratio=cfg.ratio, intra_rate=cfg.intra_rate,
                    log=log) as cluster:
        w = run_phase(cluster, cfg, "main")
        train = train_all(cluster, cfg, log)
        rate, intra_rate = cluster.rate, cluster.intra_rate  # "auto" resolved
    with SimCluster(NODES, 1, rate=rate, intra_rate=intra_rate, log=log) as cluster:
        w["ring"] = run_phase(cluster, cfg, "ring")
    log(f"simulated cluster: {NODES} nodes x {PER_NODE} ranks, inter-node rate {rate}")
    summary, lines = report(cfg, w, train, out)
    summary.update(rate=rate, train=train)
    (out / "results.json").write_text(json.dumps(dict(worker=w, summary=summary), indent=2))
    return summary, lines


def report_saved(cfg: ClusterBench) -> tuple[dict, list[str]]:
    """``report`` again from ``cfg.out/results.json`` (no root, no processes)."""
    from .cluster_report import report

    out = Path(cfg.out)
    saved = json.loads((out / "results.json").read_text())
    return report(cfg, saved["worker"], saved["summary"]["train"], out)


def placement_sweep(cfg: ClusterBench, pairs: list[tuple[str, str | None]],
                    log: Callable[[str], None] = say) -> list[str]:
    """(a) attention only, once per (inter rate, intra rate or None) in ``pairs``: where does
    placement matter? Writes ``placement_sweep.txt`` and a PNG; returns the table lines."""
    from .cluster_report import medians, placement_ratio, placement_report

    out, runs = Path(cfg.out).resolve(), []
    subs = [cfg.replace(out=str(out / f"sweep_{inter}_{intra or 'lo'}"), rate=inter,
                        intra_rate=intra) for inter, intra in pairs]  # bad rates raise here
    for (inter, intra), sub in zip(pairs, subs):
        with SimCluster(NODES, PER_NODE, rate=inter, intra_rate=intra, log=log) as cluster:
            w = run_phase(cluster, sub, "placement", echo=False)
        runs.append((inter, intra, w))
        log(f"done {inter}:{intra or 'loopback'}: across/inside "
            f"{placement_ratio(medians(w['attention_ms']))[2]:.2f}x")
    return placement_report(cfg, runs, out)
