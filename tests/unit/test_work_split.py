"""``usp.dims.work``: the attention backward over head groups and a norm's sequence tiles,
chosen from shapes alone; the same gradients as one call / one tile, and the planner prices
what they hold."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from usp.bench.gpu_checks_attention import _reference, _run_ring
from usp.config import ModelConfig
from usp.dims import work
from usp.kernels import get_kernel
from usp.models.decoder import RMSNorm
from usp.planner.activations import attention_buffers, norm_work_bytes
from usp.ring import RingPlan, ring_backward, ring_forward


@pytest.mark.parametrize("hq,hkv,parts", [(8, 2, 1), (8, 2, 2), (8, 2, 4), (8, 2, 8),
                                          (6, 3, 2), (12, 4, 8), (4, 4, 3), (6, 1, 4)])
def test_head_groups_cover_each_query_head_once_with_its_kv_head(hq, hkv, parts):
    groups = work.head_groups(hq, hkv, parts)
    g = hq // hkv
    assert [h for qh, _ in groups for h in qh] == list(range(hq))
    for qh, kh in groups:
        assert set(kh) == {h // g for h in qh}  # exactly the KV heads its query heads use
    assert len(groups) == (parts if parts <= hkv else hkv * min(g, -(-parts // hkv)))


def test_head_groups_refuse_query_heads_that_are_no_multiple_of_kv_heads():
    with pytest.raises(ValueError, match="multiple of KV heads"):
        work.head_groups(3, 2, 2)


def test_the_fewest_groups_within_the_limit_down_to_one_head():
    S, d, a = 1 << 16, 128, 2
    whole = work.call_bytes(S, S, 8, 2, d, a)
    assert work.backward_head_groups(S, S, 8, 2, d, a, whole) == work.head_groups(8, 2, 1)
    two = work.backward_head_groups(S, S, 8, 2, d, a, whole - 1)
    assert len(two) == 2 and all(len(kh) == 1 for _, kh in two)
    assert work.call_bytes(S, S, 4, 1, d, a) <= whole - 1
    assert len(work.backward_head_groups(S, S, 8, 2, d, a, 1)) == 8  # one query head a call
    # five KV heads: every KV head whole (5 calls) before any is split, though 5 is no
    # power of two
    five = work.backward_head_groups(S, S, 20, 5, d, a, work.call_bytes(S, S, 4, 1, d, a))
    assert [(len(qh), len(kh)) for qh, kh in five] == [(4, 1)] * 5
    # short sequences stay one call under the default limit
    assert len(work.backward_head_groups(4096, 4096, 32, 8, 128, 2)) == 1


def _qkvd(hq, hkv, dtype, L=64, d=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(1, L, h, d, generator=gen, dtype=torch.float64).to(dtype)
            for h in (hq, hkv, hkv, hq)]


def _dense_grads(q, k, v, do, scale):
    """fp64 causal attention's dq, dk, dv (the GPU check's reference)."""
    return _reference(q, k, v, do, True, scale)[2:]


class _Counting:
    """A kernel that counts its backward calls and the query heads of each."""

    def __init__(self, kernel):
        self.kernel, self.heads = kernel, []

    def forward(self, *args, **kw):
        return self.kernel.forward(*args, **kw)

    def backward(self, dout, q, *args, **kw):
        self.heads.append(q.shape[2])
        return self.kernel.backward(dout, q, *args, **kw)


@pytest.mark.parametrize("hq,hkv", [(8, 2), (6, 1), (4, 4)])
def test_grouped_backward_equals_one_call(monkeypatch, hq, hkv):
    """One kernel call against head groups (the limit forced down to one query head a call,
    and to whole KV heads; the calls counted): fp32 within 1e-6 (whole KV heads: bit for
    bit); bf16 no farther from fp64 attention than twice one call's error."""
    kern, scale = _Counting(get_kernel("torch")), 0.25
    for dtype in (torch.float32, torch.bfloat16):
        q, k, v, do = _qkvd(hq, hkv, dtype)
        plan = RingPlan(0, 1, q.shape[1], True, "contiguous")
        out, lse = ring_forward(q, k, v, None, plan, kern, scale)
        one = ring_backward(do, q, k, v, out, lse, None, plan, kern, scale)
        whole_kv = work.call_bytes(q.shape[1], q.shape[1], hq // hkv, 1, 16, q.element_size())
        assert kern.heads == [hq]  # one call at the default limit
        for limit, heads in ((1, [1] * hq), (whole_kv, [hq // hkv] * hkv)):
            monkeypatch.setattr(work, "CALL_BYTES", limit)
            kern.heads = []
            grouped = ring_backward(do, q, k, v, out, lse, None, plan, kern, scale)
            assert kern.heads == heads
            if dtype == torch.float32:
                for a, b in zip(grouped, one):
                    assert a.dtype == b.dtype and (a - b).abs().max() <= 1e-6
                if limit == whole_kv:
                    assert all(torch.equal(a, b) for a, b in zip(grouped, one))
            else:
                ref = _dense_grads(q, k, v, do, scale)
                for a, b, r in zip(grouped, one, ref):
                    err_a, err_b = ((x.double() - r).abs().max() for x in (a, b))
                    assert err_a <= 2 * err_b + 1e-5, (err_a, err_b)
        monkeypatch.setattr(work, "CALL_BYTES", 1 << 30)
        kern.heads = []


def test_grouped_ring_backward_equals_one_call_per_block(monkeypatch):
    """The ring (2 ranks over threads, zigzag, GQA 8/2): head groups of one query head a
    call (every backward call one head) give the gradients of one call per block within
    1e-6 (fp32), and both are fp64 attention's within 2e-5."""
    kern, scale = _Counting(get_kernel("torch")), 0.25
    q, k, v, do = _qkvd(8, 2, torch.float32)
    one = _run_ring(q, k, v, do, 2, True, "zigzag", kern, scale)
    calls = len(kern.heads)
    assert set(kern.heads) == {8}
    monkeypatch.setattr(work, "CALL_BYTES", 1)
    kern.heads = []
    grouped = _run_ring(q, k, v, do, 2, True, "zigzag", kern, scale)
    assert set(kern.heads) == {1} and len(kern.heads) == 8 * calls
    for a, b in zip(grouped, one):
        assert (a - b).abs().max() <= 1e-6
    for a, r in zip(grouped[1:], _dense_grads(q, k, v, do, scale)):
        assert (a.double() - r).abs().max() <= 2e-5


def test_a_norm_tiles_itself_past_the_limit_with_the_untiled_result(monkeypatch):
    """With one tile's work over ``NORM_BYTES`` a norm asked for 1 tile takes 4 (the rule,
    also on the q/k norms' [B, n, H, d] inputs): the output bit for bit, the input's gradient
    bit for bit, the weight's within 1e-6 of its largest; the planner's norm work follows
    the rule."""
    n, D = 256, 64
    gen = torch.Generator().manual_seed(0)
    for shape in ((2, n, D), (2, n, 4, D // 4)):
        x0, g0 = torch.randn(*shape, generator=gen), torch.randn(*shape, generator=gen)
        got = {}
        for limit in (1 << 30, work.NORM_WORK * D * n // 4):
            monkeypatch.setattr(work, "NORM_BYTES", limit)
            norm, x = RMSNorm(shape[-1], 1e-5), x0.clone().requires_grad_()
            calls = []
            norm._normalise = lambda t, f=norm._normalise: calls.append(t.shape[1]) or f(t)
            y = norm(x)
            y.backward(g0)
            got[limit] = (y.detach(), x.grad, norm.weight.grad, calls[0])
        (y1, gx1, gw1, n1), (y4, gx4, gw4, n4) = got.values()
        assert n1 == n and n4 == n // 4  # a tile's rows as computed
        assert torch.equal(y1, y4) and torch.equal(gx1, gx4)
        assert (gw1 - gw4).abs().max() <= 1e-6 * gw1.abs().max()  # summed tile by tile
    m = ModelConfig(dim=D, n_heads=4, n_kv_heads=4)
    assert norm_work_bytes(m, n) == work.NORM_WORK * D * n // 4
    monkeypatch.setattr(work, "NORM_BYTES", 1 << 30)
    assert norm_work_bytes(m, n) == work.NORM_WORK * D * n
    assert norm_work_bytes(replace(m, norm_tiles=2), n) == work.NORM_WORK * D * n / 2
    monkeypatch.setattr(work, "NORM_BYTES", work.NORM_WORK * D * n // 4)
    assert norm_work_bytes(replace(m, hf="llama"), n) == work.NORM_WORK * D * n  # its own


def test_the_planner_prices_the_flash_kernels_workspace_by_head_group():
    """On CUDA the attention backward holds the flash kernel's workspace for its largest head
    group (``work.call_bytes``): at 1M tokens a rank (ulysses 1, 32/8 heads) the call takes
    groups, and the priced backward grows by that call's workspace against the CPU pricing
    of the same groups' gradients; a ring prices no fp32 sum of a split KV head (it adds
    into its accumulators), ring 1 does."""
    S, hq, hkv, d, a = 1 << 20, 32, 8, 128, 2
    groups = work.backward_head_groups(S, S, hq, hkv, d, a)
    assert len(groups) > hkv  # one KV head's query heads split
    _, cpu = attention_buffers(S, 1, 1, hq, hkv, d, a, device="cpu")
    _, cuda = attention_buffers(S, 1, 1, hq, hkv, d, a, device="cuda")
    qh, kh = max(groups, key=lambda g: len(g[0]))
    assert cuda - cpu == pytest.approx(work.call_bytes(S, S, len(qh), len(kh), d, a)
                                       - work.call_bytes(S, S, len(qh), len(kh), d, a, False))
    one = work.group_bytes(S, S, hq, hkv, d, a, one_call=True)
    assert one - work.group_bytes(S, S, hq, hkv, d, a, one_call=False) == 2 * S * d * 4


def test_uneven_heads_are_priced_by_each_ranks_own_groups():
    """8/2 heads on ulysses 3: the ranks hold (3 q, 1 KV), (2, 2), (3, 1); the planner prices
    the worst rank's own groups (a max over the query and KV counts of different ranks would
    be no rank's: 3 query heads over 2 KV heads)."""
    from usp.dims.heads import head_split

    S, d, a = 1 << 20, 128, 2
    split = head_split(8, 2, 3)
    assert list(zip(split.q_counts, split.kv_counts)) == [(3, 1), (2, 2), (3, 1)]
    _, got = attention_buffers(3 * S, 1, 3, 8, 2, d, a, device="cuda")
    worst = max(work.group_bytes(3 * S, 3 * S, q, k, d, a, one_call=True)
                for q, k in [(3, 1), (2, 2)])
    assert worst == work.group_bytes(3 * S, 3 * S, 3, 1, d, a, one_call=True)
    assert got > worst  # returns (the max over mixed ranks' counts never settled on a group)
