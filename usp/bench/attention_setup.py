"""What the attention benchmark (``usp.bench.attention``) times: its settings
(``AttentionBench``, checked before any process starts) and one row of its table (``Row``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..config.checks import at_least, one_of
from ..dims.stages import check_a2a_chunks
from ..rules import check_degrees, check_seq_len
from ..dims.heads import check_heads
from .timing import default_threads

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
          "fp64": torch.float64}
QUICK = dict(seq_len=1024, warmup=1, iters=3)  # the smoke-test size


def parse_layouts(text: str) -> tuple[tuple[int, int], ...]:
    """``"4x1,2x2"`` -> ((4, 1), (2, 2)): ULYSSESxRING, comma-separated."""
    out = []
    for item in text.split(","):
        try:
            u, r = (int(x) for x in item.lower().split("x"))
        except ValueError:
            raise ValueError(f"bad layout {item!r}: write ULYSSESxRING, e.g. 4x1,2x2,1x4") from None
        out.append((u, r))
    return tuple(out)


def default_layouts(nprocs: int, heads: int, kv_heads: int) -> tuple[tuple[int, int], ...]:
    """Every (ulysses, ring) with u * r = nprocs whose ulysses degree the heads allow,
    ulysses first: (4, 1), (2, 2), (1, 4) for 4."""
    out = []
    for u in range(nprocs, 0, -1):
        if nprocs % u == 0:
            try:
                check_heads(heads, kv_heads, u)
            except ValueError:
                continue
            out.append((u, nprocs // u))
    return tuple(out)


@dataclass
class AttentionBench:
    """What to time: one attention call [B, L, Hq|Hkv, d] on ``nprocs`` ranks.

    ``kv_heads``, ``layouts`` and ``threads`` default (None) to ``heads``,
    ``default_layouts`` and ``default_threads``. Every layout must use all ``nprocs``
    ranks (one sequence-parallel group). Bad values raise ``ValueError`` here, before any
    process starts.
    """

    nprocs: int = 4
    batch: int = 1
    seq_len: int = 8192
    heads: int = 8
    kv_heads: int | None = None
    head_dim: int = 64
    causal: bool = True
    dtype: str = "fp32"  # a key of DTYPES
    layouts: tuple[tuple[int, int], ...] | None = None
    balance: str = "zigzag"
    warmup: int = 1
    iters: int = 5
    threads: int | None = None
    # peer(bench) -> (row config or None, skip reason or None, version or None), run by
    # every rank (collective): another implementation's row, first in the table
    peer: Callable | None = None
    # a usp row per count for layouts with ulysses > 1; "auto": no count given, the mesh's
    # default (usp_attention's default path)
    a2a_chunks: tuple[int | str, ...] = (1,)
    # how messages travel, a row each: "auto" (the mesh's default: ulysses and ring messages
    # in pieces where their groups cross hosts over gloo) and/or "whole"
    # (SPMesh.build(fragment_bytes=None))
    pieces: tuple[str, ...] = ("auto",)

    def __post_init__(self) -> None:
        at_least("bench", 1, nprocs=self.nprocs, batch=self.batch, heads=self.heads,
                 head_dim=self.head_dim, iters=self.iters)
        at_least("bench", 0, warmup=self.warmup)
        one_of("bench.dtype", self.dtype, tuple(DTYPES))
        if self.kv_heads is None:
            self.kv_heads = self.heads
        if self.threads is None:
            self.threads = default_threads(self.nprocs)
        at_least("bench", 1, kv_heads=self.kv_heads, threads=self.threads)
        if self.layouts is None:
            self.layouts = default_layouts(self.nprocs, self.heads, self.kv_heads)
        self.layouts = tuple((int(u), int(r)) for u, r in self.layouts)
        for u, r in self.layouts:
            if check_degrees(self.nprocs, u, r) != 1:
                raise ValueError(
                    f"layout {u}x{r} uses {u * r} of {self.nprocs} processes; the benchmark "
                    f"times one sequence-parallel group, so pick ulysses x ring = {self.nprocs}")
            check_heads(self.heads, self.kv_heads, u)
            check_seq_len(self.seq_len, u, r, self.balance)
            for c in self.a2a_chunks if u > 1 else ():
                if c != "auto":
                    check_a2a_chunks(c, self.heads, self.kv_heads, u)
        if not self.a2a_chunks:
            raise ValueError("bench.a2a_chunks is empty; pass at least one count, e.g. 1")
        if not self.pieces or set(self.pieces) - {"auto", "whole"}:
            raise ValueError(f"bench.pieces={self.pieces!r}: give auto and/or whole")

    def usp_rows(self) -> list[tuple[int, int, int | str, str]]:
        """(ulysses, ring, a2a_chunks, pieces) per usp row; ulysses 1 layouts: one row per
        ``pieces``."""
        return [(u, r, c, pc) for u, r in self.layouts
                for c in (self.a2a_chunks if u > 1 else self.a2a_chunks[:1])
                for pc in self.pieces]


@dataclass
class Row:
    name: str
    kind: str  # "usp" | "peer"
    ulysses: int
    ring: int
    times_ms: list[float] = field(default_factory=list)
    max_abs_diff: float = float("nan")  # out, dq, dk, dv vs the first row's
    a2a_chunks: int = 1  # the stages the row's calls ran
    variant: str = "c1"  # a2a_chunks as asked ("c2", "auto(c4)"), and " whole" for whole messages
    a2a_exposed_ms: list[float] = field(default_factory=list)  # per timed round
    a2a_hidden_ms: list[float] = field(default_factory=list)
    cpu_ms: list[float] = field(default_factory=list)  # process CPU per call, all its threads

    def stats(self) -> dict:
        t = torch.tensor(self.times_ms, dtype=torch.float64)
        std = t.std().item() if len(t) > 1 else 0.0
        out = dict(mean_ms=t.mean().item(), std_ms=std, min_ms=t.min().item(),
                   median_ms=t.median().item())
        exp, hid = (sum(x) / len(x) if x else None
                    for x in (self.a2a_exposed_ms, self.a2a_hidden_ms))
        cpu = sum(self.cpu_ms) / len(self.cpu_ms) if self.cpu_ms else None
        return dict(out, a2a_exposed_mean_ms=exp, a2a_hidden_mean_ms=hid,
                    a2a_exposed_share=None if exp is None else exp / out["mean_ms"],
                    cpu_mean_ms=cpu)
