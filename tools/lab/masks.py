"""Sliding windows and packed documents against full causal attention (``tools.bench_masks``).

For each (ulysses, ring) layout one mesh times ``usp_attention`` forward+backward for every
row, interleaved round-robin (``timing.round_robin``: the slowest rank's time per call),
so machine noise lands on all rows alike:

- ``causal zigzag``: full causal attention, the balanced layout (the baseline);
- ``causal contiguous``: the same on contiguous segments;
- ``window contiguous`` / ``window zigzag``: causal with ``window`` (default L/8);
- ``documents zigzag``: causal within packed documents of ``doc_len`` tokens.

Each row also reports its local kernel calls per ring step (``CommStats.kernel_calls``,
summed over the ranks of one ring), forward and backward: the blocks a mask leaves empty
make none, and a window shorter than a segment on contiguous segments stops the ring
early (``usp.planner.traffic.windowed_ring_hops``).
"""

from __future__ import annotations

import json
import os
import tempfile
from collections import Counter
from dataclasses import asdict, dataclass, field
from statistics import median

import torch
import torch.distributed as dist

from usp.rules import check_degrees, check_seq_len
from .cli import TimedBench

ROWS = ("causal zigzag", "causal contiguous", "window contiguous", "window zigzag",
        "documents zigzag")


@dataclass(frozen=True)
class MasksBench(TimedBench):
    """What to time: every row of ``ROWS`` on each (ulysses, ring) of ``layouts``, all with
    the same batch, sequence, heads and dtype (batch, head dim, dtype and timing:
    ``TimedBench``). ``window`` None: seq_len // 8."""

    layouts: tuple[tuple[int, int], ...] = ((1, 4), (2, 2))
    seq_len: int = 8192
    heads: int = 8
    kv_heads: int = 8
    window: int | None = None
    doc_len: int = 512

    def __post_init__(self):
        if not self.layouts:
            raise ValueError("layouts is empty; give at least one (ulysses, ring) pair")
        for u, r in self.layouts:
            check_degrees(u * r, u, r)
            check_seq_len(self.seq_len, u, r, "zigzag")  # the strictest of the rows
        if len({u * r for u, r in self.layouts}) != 1:
            raise ValueError(f"layouts {self.layouts} need different process counts; time "
                             f"layouts of one world size per run")
        super().__post_init__()
        if self.rounds < 1 or self.warmup < 0 or self.doc_len < 1:
            raise ValueError(f"need rounds >= 1, warmup >= 0, doc_len >= 1; got "
                             f"{self.rounds}, {self.warmup}, {self.doc_len}")

    @property
    def window_len(self) -> int:
        return self.window if self.window is not None else self.seq_len // 8


@dataclass
class MasksRow:
    ulysses: int
    ring: int
    name: str
    times_ms: list[float] = field(default_factory=list)  # slowest rank, per round
    calls: dict = field(default_factory=dict)  # {"forward"|"backward": [calls per step]}

    @property
    def median_ms(self) -> float:
        return median(self.times_ms)


def _row_kwargs(name: str, cfg: MasksBench, ids: torch.Tensor) -> tuple[str, dict]:
    """(balance, usp_attention mask keywords) of row ``name``; ``ids``: global [B, L]."""
    balance = name.split()[-1]
    if name.startswith("window"):
        return balance, dict(window=cfg.window_len)
    if name.startswith("documents"):
        return balance, dict(segment_ids=ids)
    return balance, {}


def _calls_per_step(delta: Counter, mesh) -> dict:
    """{phase: [calls per ring step]} summed over the ranks of one ring."""
    t = torch.zeros(2, mesh.ring, dtype=torch.float64)
    for (phase, step), n in delta.items():
        t[0 if phase == "forward" else 1, step] += n
    dist.all_reduce(t, group=mesh.group("sp"))  # every ring of the SP group
    t /= mesh.ulysses
    return {"forward": [int(x) for x in t[0]], "backward": [int(x) for x in t[1]]}


def _layout_rows(cfg: MasksBench, ulysses: int, ring: int) -> list[MasksRow]:
    from usp import SequenceLayout, SPMesh, usp_attention
    from usp.bench.timing import round_robin

    dtype = cfg.torch_dtype
    with SPMesh.build(ulysses=ulysses, ring=ring) as mesh:
        gen = torch.Generator().manual_seed(mesh.rank)
        ids = (torch.arange(cfg.seq_len) // cfg.doc_len).expand(cfg.batch, -1)  # [B, L]
        calls, deltas = [], {}
        for name in ROWS:
            balance, kw = _row_kwargs(name, cfg, ids)
            layout = SequenceLayout(mesh, seq_len=cfg.seq_len, balance=balance)
            if "segment_ids" in kw:
                kw = dict(segment_ids=layout.shard(kw["segment_ids"], dim=1))
            n = layout.local_len
            q, k, v = (torch.randn(cfg.batch, n, h, cfg.head_dim, generator=gen, dtype=dtype)
                       .requires_grad_() for h in (cfg.heads, cfg.kv_heads, cfg.kv_heads))
            dout = torch.randn(cfg.batch, n, cfg.heads, cfg.head_dim, generator=gen, dtype=dtype)

            def call(q=q, k=k, v=v, dout=dout, layout=layout, kw=kw, name=name):
                for t in (q, k, v):
                    t.grad = None
                before = Counter(mesh.comm.kernel_calls)
                usp_attention(q, k, v, mesh=mesh, layout=layout, **kw).backward(dout)
                deltas[name] = Counter(mesh.comm.kernel_calls) - before

            calls.append(call)
        times = round_robin(calls, cfg.rounds, warmup=cfg.warmup)  # [round][row] seconds
        per_step = {name: _calls_per_step(deltas[name], mesh) for name in ROWS}
        return [MasksRow(ulysses, ring, name, [t[j] * 1e3 for t in times], per_step[name])
                for j, name in enumerate(ROWS)]


def _worker(cfg: MasksBench, path: str) -> None:
    rows = []
    for u, r in cfg.layouts:
        rows += _layout_rows(cfg, u, r)
    if dist.get_rank() == 0:
        with open(path, "w") as f:
            json.dump([asdict(r) for r in rows], f)
    dist.barrier()


def run(cfg: MasksBench) -> list[MasksRow]:
    """Spawn the layouts' processes (one world size) and time every row on each layout."""
    from usp.launch import spawn_local

    u, r = cfg.layouts[0]
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        spawn_local(_worker, u * r, cfg, path, threads=cfg.threads)
        with open(path) as f:
            return [MasksRow(**d) for d in json.load(f)]
    finally:
        os.unlink(path)


def report(cfg: MasksBench, rows: list[MasksRow]) -> str:
    """A table: per layout and row the median and min time, the ratio to that layout's
    ``causal zigzag`` row and the kernel calls per ring step (forward | backward)."""
    title = (f"usp_attention fwd+bwd, B={cfg.batch} L={cfg.seq_len} Hq/Hkv={cfg.heads}/"
             f"{cfg.kv_heads} d={cfg.head_dim} {cfg.dtype}, window {cfg.window_len}, documents "
             f"of {cfg.doc_len}, {cfg.rounds} interleaved rounds (slowest rank)")
    lines = [title, f"{'(u,r)':>6} {'row':<18} {'median ms':>10} {'min ms':>9} {'ratio':>6}  "
                    f"kernel calls per ring step, fwd | bwd"]
    base = {(r.ulysses, r.ring): r.median_ms for r in rows if r.name == ROWS[0]}
    for r in rows:
        steps = " ".join(map(str, r.calls["forward"])) + " | " + " ".join(
            map(str, r.calls["backward"]))
        lines.append(f"{f'({r.ulysses},{r.ring})':>6} {r.name:<18} {r.median_ms:>10.1f} "
                     f"{min(r.times_ms):>9.1f} {r.median_ms / base[(r.ulysses, r.ring)]:>6.2f}  "
                     f"{steps}")
    return "\n".join(lines)
