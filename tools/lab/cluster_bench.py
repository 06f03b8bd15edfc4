"""What the simulated-cluster benchmark runs (``tools.lab.cluster``): the cluster's shape,
the cases of each phase and the settings (``ClusterBench``), shared by the runner, the
workers (``cluster_worker``) and the report (``cluster_report``)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from usp.dims.heads import check_heads, head_split
from usp.rules import check_seq_len

from .simcluster import rate_to_bytes_per_s

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
