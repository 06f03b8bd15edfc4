"""The ring's plan (``usp.masks``) covers attention exactly: every (query, key) pair the
masks allow is computed once, in forward (whole diagonal) and backward (split diagonal),
for causal order alone, documents and windows on both balances; K/V travel the fewest
hops that reach the window; masks are flash-attn windows where they can be."""

from __future__ import annotations

import itertools

import pytest
import torch

from usp.masks import TILE, BlockMask
from usp.ring import RingPlan, ring_hops, segment_positions
from usp.planner.traffic import windowed_ring_hops

from _cases import document_ids, visible
from fakes_flash_attn import window_visible

WINDOWS = [None, 1, 3, 5, 9, 17, 33, 1000]


def _piece_mask(p, qpos, kpos):
    """bool [B|1, len(qs), len(ks)]: the pairs one planned call computes."""
    m, n = len(qpos[p.qs]), len(kpos[p.ks])
    if p.mask is not None:
        assert (p.mask.m, p.mask.n) == (m, n)
        assert p.mask.q0 == int(qpos[p.qs][0]) and p.mask.k0 == int(kpos[p.ks][0])
        return p.mask.visible()
    block = torch.ones(1, m, n, dtype=torch.bool)
    return block.tril() if p.causal else block


def coverage(L, ring, balance, causal, window, ids, backward, tile=None):
    """[B|1, L, L] how often the ring's plans compute each (query, key) pair."""
    seen = torch.zeros(1 if ids is None else ids.shape[0], L, L, dtype=torch.int64)
    seg = L // ring
    for rank in range(ring):
        plan = RingPlan(rank, ring, seg, causal, balance, window, ids, tile)
        diag = sum(plan.diagonal_split(), []) if backward else plan.diagonal()
        calls = [(rank, p) for p in diag]
        calls += [((rank - s) % ring, p) for s in range(1, plan.hops + 1) for p in plan.step(s)]
        qpos = segment_positions(L, ring, balance, rank)
        for src, p in calls:
            kpos = segment_positions(L, ring, balance, src)
            qi, kj = qpos[p.qs], kpos[p.ks]
            seen[:, qi[:, None], kj[None, :]] += _piece_mask(p, qpos, kpos).long()
    return seen


@pytest.mark.parametrize("ring,balance", [(1, "contiguous"), (2, "zigzag"), (2, "contiguous"),
                                          (4, "zigzag"), (4, "contiguous")])
def test_plan_covers_each_visible_pair_once(ring, balance):
    L = {1: 64, 2: 96, 4: 128}[ring]
    gen = torch.Generator().manual_seed(ring)
    ids = document_ids(2, L, gen, edge=L // (2 * ring))
    for causal, window, docs, backward, tile in itertools.product(
            (True, False), WINDOWS, (False, True), (False, True), (None, 8, 5)):
        seg_ids = ids if docs else None
        want = visible(L, causal, seg_ids, window).long()
        got = coverage(L, ring, balance, causal, window, seg_ids, backward, tile)
        assert torch.equal(got, want.expand_as(got)), (causal, window, docs, backward, tile)


def test_plain_causal_plan_is_the_zigzag_schedule():
    """No masks: one causal call on the diagonal, one whole call per earlier block (the
    first key half, or the second query half, under zigzag), none for later blocks."""
    plan = RingPlan(1, 4, 16, True, "zigzag")
    (d,) = plan.diagonal()
    assert (d.qs, d.ks, d.causal, d.mask) == (slice(0, 16), slice(0, 16), True, None)
    (a,) = plan.step(1)  # from ring rank 0: the first key half, every query
    assert (a.qs, a.ks, a.causal) == (slice(0, 16), slice(0, 8), False)
    (b,) = plan.step(2)  # from ring rank 3: the second query half, every key
    assert (b.qs, b.ks, b.causal) == (slice(8, 16), slice(0, 16), False)
    now, later = plan.diagonal_split()
    assert [(p.qs, p.ks, p.causal) for p in now] == [
        (slice(0, 8), slice(0, 8), True), (slice(8, 16), slice(8, 16), True)]
    assert [(p.qs, p.ks, p.causal) for p in later] == [(slice(8, 16), slice(0, 8), False)]
    assert RingPlan(0, 4, 16, True, "contiguous").step(1) == []


def test_ring_hops_are_the_fewest_that_reach_the_window():
    for L, ring, balance, causal, window in itertools.product(
            (64, 96), (1, 2, 3, 4), ("contiguous", "zigzag"), (True, False),
            [None, 1, 2, 3, 8, 15, 16, 17, 31, 33, 47, 63, 64, 500]):
        if L % (2 * ring):
            continue
        h = ring_hops(L, ring, balance, causal, window)
        assert h == windowed_ring_hops(L, ring, balance, causal, window), (
            L, ring, balance, causal, window)
        if 0 < h:  # the last hop carries something to some rank
            assert any(RingPlan(i, ring, L // ring, causal, balance, window).step(h)
                       for i in range(ring))


def test_blocks_with_no_shared_document_are_skipped():
    """Documents inside ring segments: no step past the diagonal has a call, nothing
    between documents is computed, and a document larger than a tile is one causal call."""
    doc, ring = 2 * TILE, 2
    L = 8 * doc
    ids = (torch.arange(L) // doc)[None].expand(2, L)  # 8 documents, 4 per segment
    plan = RingPlan(1, ring, L // ring, True, "contiguous", None, ids)
    assert plan.hops == 1 and plan.step(1) == []
    assert [(p.qs, p.ks, p.causal, p.mask) for p in plan.diagonal()] == [
        (slice(i * doc, (i + 1) * doc), slice(i * doc, (i + 1) * doc), True, None)
        for i in range(4)]


def test_band_is_flash_attn_window():
    """Every positional mask the plan makes is a flash-attn window (``window_visible``, the
    stand-in's rule); any other mask's band is that window or None."""
    planned = 0
    for ring, balance, causal, window in itertools.product(
            (1, 2, 4), ("zigzag", "contiguous"), (True, False), (2, 5, 9, 17, 40)):
        for rank in range(ring):
            plan = RingPlan(rank, ring, 128 // ring, causal, balance, window)
            for p in plan.diagonal() + sum((plan.step(s) for s in range(1, plan.hops + 1)), []):
                if p.mask is not None:
                    planned += 1
                    assert p.mask.band is not None
                    assert torch.equal(window_visible(p.mask.m, p.mask.n, *p.mask.band),
                                       p.mask.visible()[0])
    assert planned > 100
    for q0, k0, m, n, lo, hi in itertools.product((40, 47), (30, 41, 47), (5, 8), (6, 9),
                                                  (0, -3, None), (4, 11, None)):
        mask = BlockMask(q0, k0, m, n, lo, hi)
        if mask.band is not None:
            assert torch.equal(window_visible(m, n, *mask.band), mask.visible()[0])
    assert BlockMask(0, 0, 2, 2, 0, None, torch.ones(1, 2, 2, dtype=torch.bool)).band is None
