"""How evenly the ring shares the attention work of packed rows: counted, not modelled.

For rows of packed documents (document lengths per row, as a token file's ``.docs`` cut
into non-overlapping windows gives them), ``rank_work`` asks the ring's own plan
(``usp.ring.RingPlan``, every step of every ring rank) for its kernel calls and counts the
(query, key) pairs they compute (``usp.masks.piece_pairs``, what ``CommStats.kernel_pairs``
records when the ring runs), under ``zigzag`` or ``per_document`` ownership
(``usp.dims.balance``). ``imbalance`` is the busiest rank's work over the mean: a ring step
waits for its slowest rank, so this is what the ring loses to the layout.
"""

from __future__ import annotations

import random
from itertools import accumulate

import torch

from ..dims.balance import per_document_segments
from ..masks import piece_pairs
from ..ring import RingPlan

BALANCES = ("zigzag", "per_document")


def packed_rows(doc_lens, seq_len: int) -> list[tuple[int, ...]]:
    """Documents of lengths ``doc_lens`` packed in order and cut into windows of
    ``seq_len`` tokens (the last partial window dropped): each row's document lengths (a
    document cut by a window edge counts as one document in each row)."""
    ends = list(accumulate(doc_lens))
    rows, i = [], 0
    for row in range(ends[-1] // seq_len if ends else 0):
        lo, hi = row * seq_len, (row + 1) * seq_len
        cuts = []
        while i < len(ends) and ends[i] < hi:
            cuts.append(ends[i])
            i += 1
        edges = [lo, *(c for c in cuts if c > lo), hi]
        rows.append(tuple(b - a for a, b in zip(edges, edges[1:])))
    return rows


def row_ids(docs: tuple[int, ...]) -> torch.Tensor:
    """Document ids of a row: LongTensor [1, L]."""
    return torch.repeat_interleave(torch.arange(len(docs)), torch.tensor(docs))[None]


def row_plan(docs: tuple[int, ...], ring: int, balance: str, rank: int) -> RingPlan:
    """Ring rank ``rank``'s causal plan of one row under the document mask (what
    ``usp_attention`` builds for the row)."""
    if balance not in BALANCES:
        raise ValueError(f"balance must be one of {BALANCES}, got {balance!r}")
    seq_len, ids = sum(docs), row_ids(docs)
    segments = per_document_segments(docs, ring) if balance == "per_document" else None
    return RingPlan(rank, ring, seq_len // ring, True, "zigzag", None, ids, segments=segments)


def row_plans(docs: tuple[int, ...], ring: int, balance: str) -> list[RingPlan]:
    """Every ring rank's causal plan of one row under the document mask."""
    return [row_plan(docs, ring, balance, i) for i in range(ring)]


def sample_rows(count: int, n: int, seed: int) -> list[int]:
    """``n`` of the row indices ``0..count-1`` drawn at random without replacement
    (``random.Random(seed)``), in increasing order: the same rows for every run."""
    if not 0 < n <= count:
        raise ValueError(f"cannot draw {n} of {count} rows; ask for 1..{count}")
    return sorted(random.Random(seed).sample(range(count), n))


def plan_pairs(plan: RingPlan) -> int:
    """The (query, key) pairs a ring rank's forward computes (per batch row and head)."""
    return sum(piece_pairs(p) for s in range(plan.hops + 1) for p in plan.step(s))


def rank_work(docs: tuple[int, ...], ring: int, balance: str) -> list[int]:
    """Counted forward pairs of each ring rank for one row."""
    return [plan_pairs(p) for p in row_plans(docs, ring, balance)]


def imbalance(work: list[int]) -> float:
    """The busiest rank's work over the mean."""
    return max(work) * len(work) / sum(work)


def mean_p90(values: list[float]) -> tuple[float, float]:
    """Mean and 90th percentile (linear interpolation)."""
    t = torch.tensor(values, dtype=torch.float64)
    return t.mean().item(), torch.quantile(t, 0.9).item()
