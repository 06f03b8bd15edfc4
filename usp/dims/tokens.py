"""Token ownership: which global positions each sequence-parallel rank holds.

A pure function of (seq_len, ring, ulysses, balance, rank), with no mesh: the layout
(``usp.layout.SequenceLayout``) shards and gathers by it, the ring plans its blocks on it,
the planner and the checks reason about it, and a run that changes its sequence length
mid-run asks it again with the new length (``Ownership.resized``).

The sequence of length L is first cut into ring segments, then each segment is split
contiguously across the ulysses group (so the ulysses all-to-all reassembles exactly one
ring segment, in order).

- ``contiguous``: ring rank i owns tokens [i*L/r, (i+1)*L/r).
- ``zigzag``: the sequence is cut into 2r parts of L/(2r); ring rank i owns parts i and
  2r-1-i, so every ring rank has the same amount of causal work.

Example, L=16, ring=2, ulysses=2, zigzag: parts of 4 -> ring 0 owns [0:4]+[12:16],
ring 1 owns [4:8]+[8:12]; (ring 0, ulysses 1) holds tokens 12..15.

Positions are given as ``range``s of consecutive positions, in the rank's own order
(``segment_ranges``, ``rank_ranges``): two numbers per range, whatever the length, and
the form a balance that differs per row of a batch (documents split within their row)
gives as well: each row then has its own ranges.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import lru_cache

import torch

from ..rules import FIXED_BALANCES, check_seq_len


def _joined(ranges: list[range]) -> tuple[range, ...]:
    """``ranges`` with each range that starts where the previous one stops joined to it."""
    out: list[range] = []
    for r in ranges:
        if out and out[-1].stop == r.start:
            out[-1] = range(out[-1].start, r.stop)
        elif len(r):
            out.append(r)
    return tuple(out)


def _check_fixed(balance: str) -> None:
    if balance not in FIXED_BALANCES:
        raise ValueError(f"balance must be one of {FIXED_BALANCES} for one ownership of every "
                         f"row, got {balance!r}" + (
                             "; per_document rows each have their own: usp.layout.DocumentLayout"
                             if balance == "per_document" else ""))


@lru_cache(maxsize=1024)
def segment_ranges(seq_len: int, ring: int, balance: str, ring_rank: int) -> tuple[range, ...]:
    """Global positions of ring rank ``ring_rank``'s segment (L/r tokens), in segment order,
    as ranges of consecutive positions: one under ``contiguous``, two under ``zigzag``
    (one for the last ring rank, whose two parts touch)."""
    _check_fixed(balance)
    if balance == "contiguous":
        seg = seq_len // ring
        return (range(ring_rank * seg, (ring_rank + 1) * seg),)
    c = seq_len // (2 * ring)
    back = 2 * ring - 1 - ring_rank
    return _joined([range(ring_rank * c, (ring_rank + 1) * c), range(back * c, (back + 1) * c)])


@lru_cache(maxsize=1024)
def rank_ranges(seq_len: int, ring: int, ulysses: int, balance: str, ring_rank: int,
                ulysses_rank: int) -> tuple[range, ...]:
    """Global positions held by the rank at (``ring_rank``, ``ulysses_rank``): L/P tokens
    (P = ring x ulysses), the ``ulysses_rank``-th contiguous share of its ring segment."""
    n = seq_len // (ring * ulysses)
    return share(segment_ranges(seq_len, ring, balance, ring_rank), n, ulysses_rank)


def share(segment: tuple[range, ...], n: int, ulysses_rank: int) -> tuple[range, ...]:
    """The ``ulysses_rank``-th contiguous share of ``n`` tokens of a ring segment (its
    ranges, in segment order)."""
    first, out, offset = ulysses_rank * n, [], 0
    for r in segment:
        lo, hi = max(first, offset), min(first + n, offset + len(r))
        if lo < hi:  # the part of this range inside [first, first + n) of the segment
            out.append(range(r.start + lo - offset, r.start + hi - offset))
        offset += len(r)
    return _joined(out)


def position_tensor(ranges: tuple[range, ...]) -> torch.Tensor:
    """The positions of ``ranges``, in order: a new LongTensor [sum of lengths] on the CPU."""
    return torch.cat([torch.arange(r.start, r.stop) for r in ranges])


@dataclass(frozen=True)
class Ownership:
    """Token ownership for one sequence length: who holds token t on ``ring x ulysses``.

    Validated once (``rules.check_seq_len``: zigzag needs 2 x ring x ulysses | L). The
    same object on every rank; a rank asks for its own share with its coordinates.
    """

    seq_len: int
    ring: int
    ulysses: int
    balance: str = "zigzag"

    def __post_init__(self) -> None:
        _check_fixed(self.balance)
        check_seq_len(self.seq_len, self.ulysses, self.ring, self.balance)

    @property
    def local_len(self) -> int:
        """Tokens per rank: L/P."""
        return self.seq_len // (self.ring * self.ulysses)

    @property
    def segment_len(self) -> int:
        """Tokens per ring segment: L/r."""
        return self.seq_len // self.ring

    def segment(self, ring_rank: int) -> tuple[range, ...]:
        """``segment_ranges`` of ring rank ``ring_rank``."""
        return segment_ranges(self.seq_len, self.ring, self.balance, ring_rank)

    def ranges(self, ring_rank: int, ulysses_rank: int) -> tuple[range, ...]:
        """``rank_ranges`` of the rank at (``ring_rank``, ``ulysses_rank``)."""
        return rank_ranges(self.seq_len, self.ring, self.ulysses, self.balance, ring_rank,
                           ulysses_rank)

    def resized(self, seq_len: int) -> Ownership:
        """The same degrees and balance for another sequence length (checked again)."""
        return dataclasses.replace(self, seq_len=seq_len)
