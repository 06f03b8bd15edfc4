"""Uneven head splits against the nearest even ones, on the same ranks (``tools.bench_heads``).

One spawn of ``ulysses x ring`` gloo processes builds one mesh and times ``usp_attention``
forward+backward for every head count, interleaved round-robin (``timing.round_robin``,
the slowest rank's time per call), so machine noise lands on all rows alike. Every row has
the same batch, sequence length and head dim; only the head counts differ.

The cost the planner should use for an uneven split is its busiest rank: ``max q_j`` query
heads (``usp.dims.heads.head_imbalance`` x Hq/u), since each rank has its own device and the
others wait for it. ``busiest`` is the ratio of the rows' busiest-rank head counts,
``total`` the ratio of their total head counts (what sets the pace instead when the ranks
time-share fewer cores than there are processes, as on a small CPU machine); ``measured``
is the ratio of the median times.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict, dataclass, field
from statistics import median

import torch
import torch.distributed as dist

from usp.rules import check_degrees, seq_multiple

from usp.dims.heads import head_imbalance, head_split
from .cli import TimedBench


@dataclass(frozen=True)
class HeadsBench(TimedBench):
    """What to time: ``heads`` [(Hq, Hkv), ...] on one (ulysses, ring) mesh; the first entry
    is the row the others are compared with. Batch, head dim, dtype and timing: ``TimedBench``."""

    heads: tuple[tuple[int, int], ...]
    ulysses: int = 4
    ring: int = 1
    seq_len: int = 4096
    balance: str = "zigzag"
    rounds: int = field(default=5, kw_only=True)

    def __post_init__(self):
        check_degrees(self.ulysses * self.ring, self.ulysses, self.ring)
        super().__post_init__()
        if not self.heads:
            raise ValueError("heads is empty; give at least one (query heads, KV heads) pair")
        for hq, hkv in self.heads:
            head_split(hq, hkv, self.ulysses)  # refuses what cannot be split
        m = seq_multiple(self.ulysses, self.ring, self.balance)
        if self.seq_len % m:
            raise ValueError(f"seq_len {self.seq_len} is not a multiple of {m} (ulysses "
                             f"{self.ulysses}, ring {self.ring}, {self.balance}); use "
                             f"{(self.seq_len // m + 1) * m}")
        if self.rounds < 1 or self.warmup < 0:
            raise ValueError(f"need rounds >= 1 and warmup >= 0, got {self.rounds}, {self.warmup}")


@dataclass
class HeadsRow:
    hq: int
    hkv: int
    q_counts: tuple[int, ...]  # query heads per ulysses rank
    times_ms: list[float] = field(default_factory=list)  # slowest rank, per round

    @property
    def max_q(self) -> int:
        return max(self.q_counts)

    @property
    def median_ms(self) -> float:
        return median(self.times_ms)


def even_neighbours(hq: int, hkv: int, ulysses: int) -> list[tuple[int, int]]:
    """The nearest head counts below and above (Hq, Hkv) with the same query heads per KV
    head that split evenly over ``ulysses`` (each side omitted when none exists)."""
    group, out = hq // hkv, []
    below = [m for m in range(hkv - 1, 0, -1) if m * group >= ulysses]
    for ms in (below, range(hkv + 1, hkv + 4 * ulysses + 1)):
        m = next((m for m in ms if head_split(m * group, m, ulysses).even), None)
        if m is not None:
            out.append((m * group, m))
    return out


def _worker(cfg: HeadsBench, path: str) -> None:
    from usp import SequenceLayout, SPMesh, usp_attention
    from usp.bench.timing import round_robin

    dtype = cfg.torch_dtype
    with SPMesh.build(ulysses=cfg.ulysses, ring=cfg.ring) as mesh:
        layout = SequenceLayout(mesh, seq_len=cfg.seq_len, balance=cfg.balance)
        n = layout.local_len
        gen = torch.Generator().manual_seed(mesh.rank)
        calls = []
        for hq, hkv in cfg.heads:
            q, k, v = (torch.randn(cfg.batch, n, h, cfg.head_dim, generator=gen, dtype=dtype)
                       .requires_grad_() for h in (hq, hkv, hkv))
            dout = torch.randn(cfg.batch, n, hq, cfg.head_dim, generator=gen, dtype=dtype)

            def call(q=q, k=k, v=v, dout=dout):  # [B, L/P, H, d] -> fwd + bwd
                for t in (q, k, v):
                    t.grad = None
                usp_attention(q, k, v, mesh=mesh, layout=layout).backward(dout)

            calls.append(call)
        times = round_robin(calls, cfg.rounds, warmup=cfg.warmup)  # [round][row] seconds
        if dist.get_rank() == 0:
            rows = [HeadsRow(hq, hkv, head_split(hq, hkv, cfg.ulysses).q_counts,
                             [t[j] * 1e3 for t in times]) for j, (hq, hkv) in enumerate(cfg.heads)]
            with open(path, "w") as f:
                json.dump([asdict(r) for r in rows], f)
        dist.barrier()


def run(cfg: HeadsBench) -> list[HeadsRow]:
    """Spawn ``ulysses x ring`` gloo processes and time every entry of ``cfg.heads``."""
    from usp.launch import spawn_local

    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        spawn_local(_worker, cfg.ulysses * cfg.ring, cfg, path, threads=cfg.threads)
        with open(path) as f:
            return [HeadsRow(**{**d, "q_counts": tuple(d["q_counts"])}) for d in json.load(f)]
    finally:
        os.unlink(path)


def report(cfg: HeadsBench, rows: list[HeadsRow]) -> str:
    """A table: per row its split, median and min time, and its measured and predicted
    (busiest rank; total heads) time ratios to the first row."""
    base = rows[0]
    title = (f"usp_attention fwd+bwd, ulysses {cfg.ulysses} x ring {cfg.ring}, B={cfg.batch} "
             f"L={cfg.seq_len} d={cfg.head_dim} {cfg.dtype} {cfg.balance}, "
             f"{cfg.rounds} interleaved rounds (slowest rank)")
    header = (f"{'Hq/Hkv':>8} {'q heads per rank':>18} {'imbal':>6} {'median ms':>10} "
              f"{'min ms':>9} {'measured':>9} {'busiest':>8} {'total':>6}")
    lines = [title, header]
    for r in rows:
        lines.append(f"{r.hq:>4}/{r.hkv:<3} {','.join(map(str, r.q_counts)):>18} "
                     f"{head_imbalance(r.hq, r.hkv, cfg.ulysses):>6.2f} {r.median_ms:>10.1f} "
                     f"{min(r.times_ms):>9.1f} {r.median_ms / base.median_ms:>9.2f} "
                     f"{r.max_q / base.max_q:>8.2f} {r.hq / base.hq:>6.2f}")
    return "\n".join(lines)
