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

import dataclasses
import json
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from usp.validate import check_seq_len

from usp.ulysses import check_heads, head_split
from .simcluster import SimCluster, rate_to_bytes_per_s, say

NODES, PER_NODE = 2, 2
WORLD = NODES * PER_NODE
TRAIN_CASES = (("(2,2) ulysses_inner", 2, 2, "ulysses_inner"),
               ("(2,2) ring_inner", 2, 2, "ring_inner"),
               ("(4,1)", 4, 1, "ulysses_inner"), ("(1,4)", 1, 4, "ulysses_inner"))
DEGREES = ((4, 1), (2, 2), (1, 4), (1, 2))  # every (ulysses, ring) the benchmarks run
# (f): layouts whose ulysses all-to-all crosses the inter-node link, (name, u, r, placement,
# ranks per node of the cluster they run on): 2 x 2 (two ranks share a core) and 2 x 1 (one
# rank per core, so a transfer can only hide behind the rank's own compute)
CHUNK_LAYOUTS = (("(4,1)", 4, 1, "ulysses_inner", PER_NODE),
                 ("(2,2) ring_inner", 2, 2, "ring_inner", PER_NODE),
                 ("(2,1) 1 rank/node", 2, 1, "ulysses_inner", 1))
MAX_CHUNKS = 8  # best_a2a_chunks' default bound


def chunk_layouts(per_node: int = PER_NODE) -> tuple:
    """The ``CHUNK_LAYOUTS`` of the 2-node cluster with ``per_node`` ranks per node."""
    return tuple(x for x in CHUNK_LAYOUTS if x[4] == per_node)


@dataclass(frozen=True)
class ClusterBench:
    """Sizes and link rates of the benchmarks; ``out`` holds every file they write.

    ``rate``: inter-node tc rate or ``"auto"`` (loopback gloo / ``ratio``); ``intra_rate``:
    also shape loopback (None: full speed); ``queue_ms``: each shaped link's queue
    (``SimCluster``; 100 as before 2026-12-01, 30 for (f) since). Attention: one layer
    [1, ``seq_len``, ``heads`` (``kv_heads`` for K/V), ``head_dim``] fp32, ``iters`` timed
    rounds after ``warmup``; (d) at ``mem_seq_len``; ``usp-train`` at ``train_seq_len`` x
    ``train_batch``; (c) on one rank per core at each of ``ring_seq_lens``, ``ring_iters``
    rounds; the link test sends ``link_bytes``."""

    out: str = "runs/bench_cluster"
    rate: str = "auto"
    ratio: float = 9.0
    intra_rate: str | None = None
    queue_ms: float = 100.0
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
    a2a_chunks: tuple = ()

    def __post_init__(self):
        object.__setattr__(self, "ring_seq_lens", tuple(self.ring_seq_lens))
        object.__setattr__(self, "a2a_chunks", tuple(self.a2a_chunks))
        low = {k: getattr(self, k) for k, lo in (("iters", 1), ("warmup", 0), ("ring_iters", 1),
                                                   ("train_steps", 2), ("train_passes", 1),
                                                   ("train_batch", 1), ("head_dim", 1))
               if getattr(self, k) < lo}
        if low:
            raise ValueError(f"need iters, ring_iters, train_passes, train_batch, head_dim >= 1, "
                             f"warmup >= 0 and train_steps >= 2 (the first step is dropped), "
                             f"got {low}")
        if not self.queue_ms > 0:
            raise ValueError(f"queue_ms must be > 0, got {self.queue_ms}; e.g. 30")
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
        self._check_chunks()

    def _check_chunks(self) -> None:
        legal = {c for _, u, *_ in CHUNK_LAYOUTS for c in self.legal_chunks(u)}
        bad = [c for c in self.a2a_chunks if c != "auto" and c not in legal]
        if bad:
            raise ValueError(f"a2a_chunks {bad} fit no layout of {[n for n, *_ in CHUNK_LAYOUTS]}"
                             f" with {self.heads} query / {self.kv_heads} KV heads; use "
                             f"'auto' or counts in {sorted(legal)}")

    def legal_chunks(self, ulysses: int) -> list[int]:
        """Every ``a2a_chunks`` a layout with ``ulysses`` accepts for these heads (at most
        ``MAX_CHUNKS``)."""
        most = max(head_split(self.heads, self.kv_heads, ulysses).q_counts)
        return list(range(1, min(most, MAX_CHUNKS) + 1))

    def train_model(self) -> list[str]:
        """usp-train overrides for (f): a model with the attention benchmark's heads."""
        return [f"model.dim={self.heads * self.head_dim}", f"model.n_heads={self.heads}",
                f"model.n_kv_heads={self.kv_heads}"]

    @classmethod
    def parse_chunks(cls, text: str) -> tuple:
        """'1,2,auto' -> (1, 2, 'auto'); a bad item raises ValueError naming it."""
        items = [x.strip() for x in text.split(",") if x.strip()]
        bad = [x for x in items if x != "auto" and not (x.isdigit() and int(x) >= 1)]
        if bad:
            raise ValueError(f"--a2a-chunks takes integers >= 1 and 'auto', comma-separated; "
                             f"got {bad} in {text!r}, e.g. 1,2,auto")
        return tuple(x if x == "auto" else int(x) for x in items)

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(dataclasses.asdict(self), indent=2))

    @classmethod
    def load(cls, path: Path) -> ClusterBench:
        return cls(**json.loads(Path(path).read_text()))

    def replace(self, **changes) -> ClusterBench:
        return dataclasses.replace(self, **changes)


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
    from .cluster_worker import result_file

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
    from .cluster_report import chunk_picks

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
    from .cluster_report import report

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
        with SimCluster(NODES, PER_NODE, rate=inter, intra_rate=intra, log=log,
                        queue_ms=cfg.queue_ms) as cluster:
            w = run_phase(cluster, sub, "placement", echo=False)
        runs.append((inter, intra, w))
        log(f"done {inter}:{intra or 'loopback'}: across/inside "
            f"{placement_ratio(medians(w['attention_ms']))[2]:.2f}x")
    return placement_report(cfg, runs, out)
