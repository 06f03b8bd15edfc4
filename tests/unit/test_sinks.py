"""Attention sinks on one process: ``local_attention(sinks=...)`` against fp64 dense
attention with gpt-oss's formula (out, dq, dk, dv, dsinks), on the torch and reference
kernels, with and without masks; ``add_sinks`` is ``merge`` of a value-less block; bad
sinks are refused by name."""

import pytest
import torch

from usp.attention import local_attention
from usp.ring import add_sinks, merge

from _cases import TOL, dense_reference, draw


@pytest.mark.parametrize("kernel", ["torch", "reference"])
@pytest.mark.parametrize("causal,docs,window", [(True, False, None), (False, False, None),
                                                (True, True, 5), (False, True, 9)])
def test_local_attention_with_sinks_matches_dense(kernel, causal, docs, window):
    q, k, v, dout, ids = draw(2, 24, 4, 2, 8, seed=3, docs=docs, edge=6)
    sinks = 2 * torch.randn(4, generator=torch.Generator().manual_seed(1))
    ref = dense_reference(q, k, v, dout, causal, ids, window, sinks)
    ql, kl, vl, s = (t.clone().requires_grad_() for t in (q, k, v, sinks))
    out = local_attention(ql, kl, vl, causal=causal, kernel=kernel, segment_ids=ids,
                          window=window, sinks=s)
    out.backward(dout)
    for name, g, r in zip(("out", "dq", "dk", "dv", "dsinks"),
                          (out.detach(), ql.grad, kl.grad, vl.grad, s.grad), ref):
        assert (g.double() - r).abs().max().item() <= TOL[torch.float32], name


def test_a_sink_far_below_changes_nothing_and_one_far_above_takes_everything():
    q, k, v, _, _ = draw(1, 16, 2, 2, 8, seed=0)
    plain = local_attention(q, k, v)
    low = local_attention(q, k, v, sinks=torch.full((2,), -1e4))
    high = local_attention(q, k, v, sinks=torch.tensor([1e4, -1e4]))
    torch.testing.assert_close(low, plain)
    assert high[:, :, 0].abs().max() == 0
    torch.testing.assert_close(high[:, :, 1], plain[:, :, 1])


def test_add_sinks_is_the_merge_of_a_block_without_values():
    out, lse = torch.randn(2, 5, 3, 4), torch.randn(2, 3, 5)
    sinks = torch.randn(3)
    got_out, got_lse = out.clone(), lse.clone()
    add_sinks(got_out, got_lse, sinks)
    want_lse = torch.logaddexp(lse, sinks[None, :, None])
    torch.testing.assert_close(got_lse, want_lse)
    torch.testing.assert_close(got_out, out * torch.sigmoid(lse - sinks[None, :, None])
                               .transpose(1, 2)[..., None])
    again_out, again_lse = out.clone(), lse.clone()
    merge(again_out, again_lse, torch.zeros(()), sinks[None, :, None].expand(2, 3, 5))
    assert torch.equal(again_out, got_out) and torch.equal(again_lse, got_lse)


@pytest.mark.parametrize("sinks,message", [
    (torch.zeros(3), r"sinks must be a floating tensor \[Hq\] = \[4\].*got \(3,\)"),
    (torch.zeros(4, dtype=torch.long), r"sinks must be a floating tensor"),
    (torch.zeros(1, 4), r"got \(1, 4\)"),
    (torch.zeros(4, device="meta"), r"sinks are on meta but q is on cpu"),
])
def test_bad_sinks_are_refused(sinks, message):
    q = torch.randn(1, 8, 4, 8)
    with pytest.raises(ValueError, match=message):
        local_attention(q, q, q, sinks=sinks)
