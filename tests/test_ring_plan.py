"""The ring's block schedule covers attention exactly: every (query, key) pair the mask
allows is computed once, in forward (whole diagonal) and in backward (split diagonal)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from usp.layout import SequenceLayout
from usp.ring import block_plan, diagonal_split

_ALL = slice(None)


def coverage(ring: int, seq_len: int, balance: str, causal: bool, split: bool) -> torch.Tensor:
    """[L, L] count of how often each (query position, key position) pair is computed."""
    mesh = SimpleNamespace(ring=ring, ulysses=1, sp_size=ring)
    lay = SequenceLayout(mesh, seq_len=seq_len, balance=balance)
    seg = seq_len // ring
    seen = torch.zeros(seq_len, seq_len, dtype=torch.int64)
    for rank in range(ring):
        now, later = diagonal_split(seg, causal) if split else ([(_ALL, _ALL, causal)], [])
        pieces = [(rank, *p) for p in now + later]
        for step in range(1, ring):
            src = (rank - step) % ring
            plan = block_plan(src, rank, seg, causal, balance)
            if plan is not None:
                pieces.append((src, *plan))
        qpos = lay.segment_indices(rank)
        for src, qs, ks, masked in pieces:
            qp, kp = qpos[qs], lay.segment_indices(src)[ks]
            block = torch.ones(len(qp), len(kp), dtype=torch.int64)
            if masked:  # the kernels' causal flag: square block, lower triangle
                assert len(qp) == len(kp)
                block = block.tril()
            seen[qp[:, None], kp[None, :]] += block
    return seen


@pytest.mark.parametrize("ring", [2, 4])
@pytest.mark.parametrize("balance", ["zigzag", "contiguous"])
@pytest.mark.parametrize("split", [False, True], ids=["forward", "backward"])
def test_causal_schedule_covers_the_mask_once(ring, balance, split):
    L = 16 * ring
    want = torch.ones(L, L, dtype=torch.int64).tril()
    assert torch.equal(coverage(ring, L, balance, causal=True, split=split), want)


@pytest.mark.parametrize("ring", [2, 4])
def test_full_attention_schedule_covers_every_pair_once(ring):
    L = 8 * ring
    for split in (False, True):
        got = coverage(ring, L, "contiguous", causal=False, split=split)
        assert torch.equal(got, torch.ones(L, L, dtype=torch.int64))


def test_diagonal_split_defers_the_unmasked_half():
    now, later = diagonal_split(8, causal=True)
    assert now == [(slice(0, 4), slice(0, 4), True), (slice(4, None), slice(4, None), True)]
    assert later == [(slice(4, None), slice(0, 4), False)]
    assert diagonal_split(1, causal=True) == ([(_ALL, _ALL, True)], [])
