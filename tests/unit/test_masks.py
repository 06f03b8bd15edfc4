"""Masks in the kernels and the merge, one process: kernels apply a ``BlockMask`` (rows
without keys included), the merge ignores rows without keys, ``local_attention`` with
documents and windows matches fp64, and bad masks are refused. The plan itself:
``test_ring_plan.py``."""

from __future__ import annotations

import itertools

import pytest
import torch

from usp.attention import local_attention

from usp.kernels import get_kernel
from usp.masks import BlockMask, check_masks
from usp.ring import merge

from _cases import dense_reference, draw


@pytest.mark.parametrize("name", ["torch", "reference"])
def test_kernel_rows_without_keys_give_zero_and_minus_inf(name):
    """A document mask that leaves rows empty: out 0 and LSE -inf there, no NaN; the other
    rows and the backward (given a finite final LSE) are exact."""
    kern = get_kernel(name)
    q, k, v, dout, _ = draw(2, 12, 4, 2, 8, seed=3)
    seg = torch.zeros(2, 12, 12, dtype=torch.bool)
    seg[:, 4:, :6] = True  # rows 0..3 see nothing
    seg[1, 9] = False  # and row 9 of batch 1
    mask = BlockMask(20, 0, 12, 12, None, None, seg)
    out, lse = kern.forward(q, k, v, False, 0.3, mask=mask)
    empty = ~seg.any(-1)  # [B, S]
    assert torch.equal(empty, mask.empty_rows())
    assert not out.isnan().any() and not lse.isnan().any()
    assert (out[empty] == 0).all() and (lse.transpose(1, 2)[empty] == float("-inf")).all()
    ref = get_kernel("reference").forward(q.double(), k.double(), v.double(), False, 0.3, mask=mask)
    assert (out.double() - ref[0]).abs().max() < 1e-5
    full_lse = lse.masked_fill(lse == float("-inf"), 0.0)  # as if other blocks gave keys
    grads = kern.backward(dout, q, k, v, out, full_lse, False, 0.3, mask=mask)
    want = get_kernel("reference").backward(
        *(t.double() for t in (dout, q, k, v, out, full_lse)), False, 0.3, mask=mask)
    for g, w in zip(grads, want):
        assert not g.isnan().any() and (g.double() - w).abs().max() < 1e-4
    assert (grads[0][empty] == 0).all()  # dq of a row that sees no key here


def test_merge_ignores_rows_without_keys():
    """Blocks whose rows see no key (LSE -inf, out 0) change nothing, also in rows that
    have seen nothing yet (out 0, LSE -inf on both sides)."""
    out = torch.randn(1, 3, 2, 4)
    out[:, 1] = 0.0  # row 1 has seen no key yet
    lse = torch.tensor([[[0.5, float("-inf"), 1.0], [0.2, float("-inf"), 2.0]]])
    before, lse_before = out.clone(), lse.clone()
    merge(out, lse, torch.zeros(1, 3, 2, 4), torch.full_like(lse, float("-inf")))
    assert torch.equal(out, before) and torch.equal(lse, lse_before)
    blk_out, blk_lse = torch.randn(1, 3, 2, 4), torch.full_like(lse, 0.7)
    merge(out, lse, blk_out, blk_lse)  # row 1's first keys: exactly the block's result
    assert torch.allclose(out[:, 1], blk_out[:, 1]) and (lse[0, :, 1] == 0.7).all()
    with pytest.raises(ValueError, match="merge accumulates in float32"):
        merge(out.bfloat16(), lse, blk_out, blk_lse)


@pytest.mark.parametrize("name", ["torch", "reference"])
def test_local_attention_with_masks_matches_fp64(name):
    L = 200
    for causal, window, docs, (hq, hkv) in itertools.product(
            (True, False), (None, 1, 13, 64, 500), (False, True), ((4, 2), (2, 2))):
        q, k, v, dout, ids = draw(2, L, hq, hkv, 8, seed=window or 0, docs=docs, edge=25)
        ref = dense_reference(q, k, v, dout, causal, ids, window)
        qs, ks, vs = (t.clone().requires_grad_() for t in (q, k, v))
        out = local_attention(qs, ks, vs, causal=causal, kernel=name, segment_ids=ids,
                              window=window)
        out.backward(dout)
        for got, want in zip((out, qs.grad, ks.grad, vs.grad), ref):
            assert (got.double() - want).abs().max().item() < 2e-5, (causal, window, docs)


def test_check_masks_refusals():
    kw = dict(batch=2, seq_len=8, device="cpu")
    with pytest.raises(ValueError, match=r"segment_ids\(2, 7\) must be \[batch, local length\]"):
        check_masks(torch.zeros(2, 7, dtype=torch.long), None, **kw)
    with pytest.raises(ValueError, match="window=0"):
        check_masks(None, 0, **kw)
    with pytest.raises(ValueError, match="kernel 'flash_attn' cannot apply segment_ids"):
        check_masks(torch.zeros(2, 8, dtype=torch.long), 4, kernel="flash_attn", **kw)
    check_masks(None, 4, kernel="flash_attn", **kw)  # a window alone it takes
    with pytest.raises(ValueError, match="window=0"):
        local_attention(*(torch.zeros(1, 4, 2, 8) for _ in range(3)), window=0)
