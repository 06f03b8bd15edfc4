"""Local kernels against fp64 math, and the LSE merge, single process."""

import pytest
import torch

from usp.attention import local_attention

from usp.kernels import get_kernel
from usp.ring import merge

from _cases import dense_reference


def _qkv(b=2, s=24, hq=4, hkv=2, d=16, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, s, h, d, generator=g, dtype=dtype) for h in (hq, hkv, hkv)]


@pytest.mark.parametrize("name", ["torch", "reference"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("hkv", [4, 2, 1])
def test_local_attention_matches_fp64(name, causal, hkv):
    q, k, v = _qkv(hkv=hkv)
    dout = torch.randn_like(q)
    ref = dense_reference(q, k, v, dout, causal)
    qs, ks, vs = (t.clone().requires_grad_() for t in (q, k, v))
    out = local_attention(qs, ks, vs, causal=causal, kernel=name)
    out.backward(dout)
    for got, want in zip((out, qs.grad, ks.grad, vs.grad), ref):
        assert (got.double() - want).abs().max().item() < 2e-5


@pytest.mark.parametrize("name", ["torch", "reference"])
def test_lse_merge_of_key_blocks_equals_full(name):
    """Attention over 3 key blocks merged by LSE == attention over all keys."""
    kern = get_kernel(name)
    q, k, v = _qkv(s=30)
    full_out, full_lse = kern.forward(q, k, v, False, 0.25)
    out = torch.zeros(q.shape)
    lse = torch.full(full_lse.shape, float("-inf"))
    for sl in (slice(0, 7), slice(7, 20), slice(20, 30)):
        merge(out, lse, *kern.forward(q, k[:, sl], v[:, sl], False, 0.25))
    assert torch.allclose(out, full_out, atol=1e-6)
    assert torch.allclose(lse, full_lse, atol=1e-6)


def test_block_backward_with_global_lse_sums_to_full():
    """Per-block backward with the final out/lse adds up to the full backward (ring's premise)."""
    kern = get_kernel("torch")
    q, k, v = _qkv(s=16)
    dout = torch.randn_like(q)
    out, lse = kern.forward(q, k, v, False, 0.25)
    dq, dk, dv = kern.backward(dout, q, k, v, out, lse, False, 0.25)
    dq_sum = torch.zeros_like(dq)
    for sl in (slice(0, 5), slice(5, 16)):
        dq_b, dk_b, dv_b = kern.backward(dout, q, k[:, sl], v[:, sl], out, lse, False, 0.25)
        dq_sum += dq_b
        assert torch.allclose(dk_b, dk[:, sl], atol=1e-5)
        assert torch.allclose(dv_b, dv[:, sl], atol=1e-5)
    assert torch.allclose(dq_sum, dq, atol=1e-5)


def test_unknown_kernel_and_missing_flash_attn():
    with pytest.raises(ValueError, match="unknown attention kernel 'cudnn'"):
        get_kernel("cudnn")
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match=r"flash-attn package.*kernel='torch'"):
            get_kernel("flash_attn")
