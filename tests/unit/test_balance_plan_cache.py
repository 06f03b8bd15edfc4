"""A ``DocumentLayout``'s ring plans, built once and reused (``usp.attention.row_plan``):
the same plan for the same rows, causal order, window and document ids, a new one when
any of them differs; and a reused plan still computes every visible pair exactly once."""

import types

import torch

from usp.attention import row_plan
from usp.dims.balance import per_document_segments
from usp.layout import DocumentLayout
from usp.ring import RingPlan

from _cases import visible
from test_ring_plan import _piece_mask

ROWS = ((5, 9, 3, 11, 1, 7, 12, 4, 20, 6, 18), (61, 3, 1, 2, 29))  # L = 96


def _layout(rows, ring, rank):
    mesh = types.SimpleNamespace(ring=ring, ulysses=1, sp_size=ring, ring_rank=rank,
                                 ulysses_rank=0)
    return DocumentLayout(mesh, rows)


def _ids(docs):
    return torch.repeat_interleave(torch.arange(len(docs)), torch.tensor(docs))[None]


def _calls(plan):
    """Every call of the plan, forward and backward, as comparable tuples."""
    def key(p):
        vis = None if p.mask is None else p.mask.visible().tolist()
        return p.qs, p.ks, p.causal, vis
    steps = [[key(p) for p in plan.step(s)] for s in range(plan.hops + 1)]
    now, later = plan.diagonal_split()
    return plan.hops, steps, [key(p) for p in now], [key(p) for p in later]


def _coverage(plans, L, backward):
    seen = torch.zeros(1, L, L, dtype=torch.int64)
    ring = len(plans)
    for rank, plan in enumerate(plans):
        diag = sum(plan.diagonal_split(), []) if backward else plan.diagonal()
        calls = [(rank, p) for p in diag]
        calls += [((rank - s) % ring, p) for s in range(1, plan.hops + 1) for p in plan.step(s)]
        qpos = plan.positions(rank)
        for src, p in calls:
            kpos = plan.positions(src)
            seen[:, qpos[p.qs][:, None], kpos[p.ks][None, :]] += _piece_mask(p, qpos, kpos).long()
    return seen


def test_same_call_reuses_the_plan_and_it_still_covers_each_pair_once():
    ring, L = 4, 96
    ids = _ids(ROWS[0])
    layouts = [_layout(ROWS, ring, rank) for rank in range(ring)]
    b = slice(0, 1)
    first = [row_plan(lay, b, True, None, ids) for lay in layouts]
    for _ in range(2):  # a second and third layer, forward and backward
        again = [row_plan(lay, b, True, None, ids.clone()) for lay in layouts]
        assert all(x is y for x, y in zip(first, again))
        for backward in (False, True):
            assert torch.equal(_coverage(again, L, backward), visible(L, True, ids, None).long())


def test_a_different_call_builds_its_own_plan():
    ring, rank = 2, 1
    lay = _layout(ROWS, ring, rank)
    seg = per_document_segments(ROWS[1], ring)
    ids = _ids(ROWS[1])
    other = _ids((40, 56))  # other document ids for the same row: other blocks are skipped
    b = slice(1, 2)
    cases = [(True, None, ids), (True, None, other), (True, 7, ids), (False, None, ids),
             (True, None, None), (True, None, ids)]
    for causal, window, row_ids in cases:
        got = row_plan(lay, b, causal, window, row_ids)
        fresh = RingPlan(rank, ring, 48, causal, "zigzag", window, row_ids, segments=seg)
        assert _calls(got) == _calls(fresh), (causal, window, row_ids is None)
    assert _calls(row_plan(lay, b, True, None, other)) != _calls(row_plan(lay, b, True, None, ids))
    # rows of a batch are planned apart: row 0's plan is not row 1's
    assert row_plan(lay, slice(0, 1), True, None, _ids(ROWS[0])) is not row_plan(
        lay, b, True, None, ids)


def test_diagonal_split_is_kept_and_its_lists_are_the_callers():
    plan = RingPlan(0, 2, 48, True, "zigzag", None, _ids(ROWS[1]),
                    segments=per_document_segments(ROWS[1], 2))
    now, later = plan.diagonal_split()
    before = _calls(plan)
    now.clear(), later.append(None)
    assert _calls(plan) == before
