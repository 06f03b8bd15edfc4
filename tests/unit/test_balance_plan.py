"""The ring's block plan on a row's per-document ownership: every visible pair computed
exactly once, and the work it counts (``CommStats.kernel_pairs``) even across ranks."""

import itertools

import pytest
import torch

from usp.bench.timing import LoopbackComm
from usp.comm import CommStats
from usp.dims.balance import per_document_segments, visible_pairs
from usp.kernels import get_kernel
from usp.masks import piece_pairs
from usp.ring import RingAttention, RingPlan

from _cases import visible
from test_ring_plan import _piece_mask

ROWS = {
    "one long": (96,),
    "many short": (5, 9, 3, 11, 1, 7, 12, 4, 20, 6, 18),
    "longer than L/r, shorter than 2r": (61, 3, 1, 2, 29),
}


def _ids(docs, batch=2):
    return torch.repeat_interleave(torch.arange(len(docs)), torch.tensor(docs))[None].expand(
        batch, -1)


def _plans(docs, ring, window=None, tile=8):
    segments = per_document_segments(docs, ring)
    L = sum(docs)
    return [RingPlan(i, ring, L // ring, True, "zigzag", window, _ids(docs), tile, segments)
            for i in range(ring)]


@pytest.mark.parametrize("name", sorted(ROWS))
@pytest.mark.parametrize("ring", [2, 4, 8])
def test_plan_covers_each_visible_pair_once(name, ring):
    docs = ROWS[name]
    L = sum(docs)
    for window, backward in itertools.product((None, 5, 40), (False, True)):
        seen = torch.zeros(2, L, L, dtype=torch.int64)
        for rank, plan in enumerate(_plans(docs, ring, window)):
            diag = sum(plan.diagonal_split(), []) if backward else plan.diagonal()
            calls = [(rank, p) for p in diag]
            calls += [((rank - s) % ring, p) for s in range(1, plan.hops + 1)
                      for p in plan.step(s)]
            qpos = plan.positions(rank)
            for src, p in calls:
                kpos = plan.positions(src)
                seen[:, qpos[p.qs][:, None], kpos[p.ks][None, :]] += _piece_mask(
                    p, qpos, kpos).long()
        want = visible(L, True, _ids(docs), window).long()
        assert torch.equal(seen, want), (window, backward)


def test_counted_pairs_are_the_work_of_each_rank():
    """Documents aligned to the tiles: each rank's counted forward pairs are exactly the
    visible pairs of its queries (``visible_pairs``), and equal across ranks."""
    docs, ring = (64, 32, 128, 32), 4
    segments = per_document_segments(docs, ring)
    work = []
    for plan in _plans(docs, ring, tile=8):
        stats = CommStats()
        q, k, v = (torch.randn(1, sum(docs) // ring, 1, 4, requires_grad=True) for _ in range(3))
        RingAttention.apply(q, k, v, LoopbackComm(), plan, get_kernel("reference"), 0.5, stats)
        fwd = sum(n for (phase, _), n in stats.kernel_pairs.items() if phase == "forward")
        steps = [plan.step(s) for s in range(plan.hops + 1)]
        assert fwd == sum(piece_pairs(p) for p in itertools.chain(*steps))
        assert fwd == visible_pairs(segments[plan.rank], docs)
        work.append(fwd)
    assert len(set(work)) == 1


@pytest.mark.parametrize("ring", [2, 4])
def test_documents_of_a_tile_or_more_need_no_document_mask(ring):
    """Documents off the tile grid, every part at least a tile long: a rank's spans are cut
    at the documents' edges, so no call carries a mask (each is whole or causal) and each
    rank's counted pairs are exactly the visible pairs of its queries."""
    docs, tile = (75, 67, 91, 87), 8
    segments = per_document_segments(docs, ring)
    for plan in _plans(docs, ring, tile=tile):
        pieces = [p for s in range(plan.hops + 1) for p in plan.step(s)]
        pieces += sum(plan.diagonal_split(), [])
        assert all(p.mask is None for p in pieces)
        fwd = sum(piece_pairs(p) for s in range(plan.hops + 1) for p in plan.step(s))
        assert fwd == visible_pairs(segments[plan.rank], docs)


def test_trailing_steps_empty_for_every_rank_are_dropped():
    ones = (1,) * 64  # one-token documents: nothing to see on another rank
    plans = _plans(ones, 4)
    assert [(p.hops, p.dropped_hops) for p in plans] == [(0, 3)] * 4
    long = _plans((64,), 4)
    assert [(p.hops, p.dropped_hops) for p in long] == [(3, 0)] * 4
    # pairs of two-token documents: ranks see the rank that holds their first token only
    pairs = _plans((2,) * 32, 4)
    assert len({p.hops for p in pairs}) == 1
    assert any(p.step(pairs[0].hops) for p in pairs)  # the last step made carries something
    stats = CommStats()
    q, k, v = (torch.randn(1, 16, 1, 4, requires_grad=True) for _ in range(3))
    out = RingAttention.apply(q, k, v, None, plans[1], get_kernel("reference"), 0.5, stats)
    out.sum().backward()  # no hop at all: no transport needed
    assert stats.hops_dropped == {"forward": 3, "backward": 3}
