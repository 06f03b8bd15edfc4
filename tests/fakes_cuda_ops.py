"""Stand-ins for the four CUDA aten attention ops, enforcing their contracts on CPU tensors.

Signatures: the ops' schemas in torch 2.13 (``torch.ops.aten.<op>.default._schema``;
``test_stand_ins_have_the_real_schemas`` compares them). Checks: those the CUDA code makes
in torch 2.11-2.13, read in ``aten/src/ATen/native/transformers/cuda/attention.cu``,
``attention_backward.cu``, ``flash_attn/flash_api.cpp`` (``mha_fwd``/``mha_bwd``) and
``mem_eff_attention/kernel_backward.h`` (``check_supported``), with their messages. Values:
fp64 math written out here (``fp64_forward``/``fp64_backward``, with an additive bias), so
the stand-ins do not lean on usp's own kernels. Every call is recorded in ``calls``.
``attn_bias`` (the efficient ops): the checks of ``_efficient_attention_forward/_backward``
(dtype, [B, H, S, Sk] shape, unit last stride) and of the kernels' ``check_supported``
(batch, head and row strides a multiple of 16 bytes); a row whose bias is -inf everywhere
comes back NaN (the real kernel's value there is not a contract). Dropout and the varlen
path are not modelled: the stand-ins refuse them.
"""

from __future__ import annotations

import math

import torch

from usp.compat import CudaSdpaOps

HALF = (torch.float16, torch.bfloat16)


def _require(ok: bool, msg: str) -> None:
    if not ok:
        raise RuntimeError(msg)


def _bshd(*xs):
    return [x.transpose(1, 2) for x in xs]  # [B, H, S, d] -> [B, S, H, d] views, as the ops do


def _scores(q, k, causal, scale, bias):
    """BSHD fp64 -> [B, H, S, Sk] scores (K expanded to q's heads), causal top-left."""
    g = q.shape[2] // k.shape[2]
    s = torch.einsum("bshd,bkhd->bhsk", q.double(),
                     k.double().repeat_interleave(g, 2)) * scale
    if causal:
        tril = torch.ones(s.shape[-2:], dtype=torch.bool).tril()
        s = s.masked_fill(~tril, float("-inf"))
    return s if bias is None else s + bias.double()


def fp64_forward(q, k, v, causal, scale, bias=None):
    """BSHD in -> out [B, S, Hq, d] fp64, lse [B, Hq, S] fp64 (rows without a key: NaN, -inf)."""
    s = _scores(q, k, causal, scale, bias)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse[..., None])
    g = q.shape[2] // k.shape[2]
    return torch.einsum("bhsk,bkhd->bshd", p, v.double().repeat_interleave(g, 2)), lse


def fp64_backward(dout, q, k, v, out, lse, causal, scale, bias=None):
    """dq, dk, dv (fp64, dk/dv with Hkv heads) from the rows' final out and lse."""
    g = q.shape[2] // k.shape[2]
    s = _scores(q, k, causal, scale, bias)
    p = torch.exp(s - lse.double()[..., None])
    do, ve = dout.double(), v.double().repeat_interleave(g, 2)
    dv = torch.einsum("bhsk,bshd->bkhd", p, do)
    delta = (do * out.double()).sum(-1).transpose(1, 2)[..., None]
    ds = p * (torch.einsum("bshd,bkhd->bhsk", do, ve) - delta) * scale
    dq = torch.einsum("bhsk,bkhd->bshd", ds, k.double().repeat_interleave(g, 2))
    dk = torch.einsum("bhsk,bshd->bkhd", ds, q.double())
    b, sk, h, d = dk.shape
    return dq, dk.view(b, sk, h // g, g, d).sum(3), dv.view(b, sk, h // g, g, d).sum(3)


def _check_bias(bias, q, k):
    """_efficient_attention_forward/_backward's and check_supported's rules for attn_bias."""
    b, sq, h, _ = q.shape
    _require(bias.dtype == q.dtype, "invalid dtype for bias - should match query's dtype")
    _require(bias.dim() == 4, "Bias expected in BMHK format")
    for got, want, name in zip(bias.shape, (b, h, sq, k.shape[1]),
                               ("batch", "head", "seqlenQ", "seqlenKV")):
        _require(got == want, f"attn_bias: wrong shape ({name} dimension)")
    _require(bias.stride(3) == 1, "attn_bias: wrong alignment (last dimension must be contiguous)")
    align = 16 // bias.element_size()
    for dim, (n, name) in enumerate(((b, "strideB"), (h, "strideH"), (sq, "strideM"))):
        _require(n <= 1 or bias.stride(dim) % align == 0,
                 f"attn_bias is not correctly aligned ({name})")


def _scale(q, scale):
    return q.shape[-1] ** -0.5 if scale is None else scale


def _check_flash_inputs(q, k, v):
    """mha_fwd / mha_bwd: fp16/bf16, one dtype, last dim contiguous, d % 8, GQA divides."""
    _require(q.dtype in HALF, "FlashAttention only support fp16 and bf16 data type")
    _require(k.dtype == q.dtype and v.dtype == q.dtype,
             "query and key/value must have the same dtype")
    for t in (q, k, v):
        _require(t.stride(-1) == 1, "Input tensor must have contiguous last dimension")
    _require(q.shape[-1] % 8 == 0, "head_size must be a multiple of 8, this is ensured by padding!")
    _require(q.shape[-1] <= 256, "FlashAttention only supports head dimension at most 256")
    _require(q.shape[2] % k.shape[2] == 0,
             "Number of heads in key/value must divide number of heads in query")


class FakeCudaOps:
    """The four ops as bound methods; ``ops()`` gives them in ``usp.compat.CudaSdpaOps`` form."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, int]] = []  # (op, query heads, key heads)

    def ops(self) -> CudaSdpaOps:
        return CudaSdpaOps(self.flash, self.flash_backward, self.efficient, self.efficient_backward)

    def flash(self, query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False,
              *, scale=None):
        self.calls.append(("flash", query.shape[1], key.shape[1]))
        _require(dropout_p == 0.0 and not return_debug_mask,
                 "stand-in: dropout/debug mask not modelled")
        q, k, v = _bshd(query, key, value)
        _check_flash_inputs(q, k, v)
        out, lse = fp64_forward(q, k, v, is_causal, _scale(q, scale))
        # attention.cu returns Tensor() for cum_seq_q/k (None here); mha_fwd returns rng_state
        # uint64 [2] and _unused uint64 [], unwritten without dropout
        # output: a dense [B, S, H, d] buffer, returned as its [B, H, S, d] view
        rng_state, unused = torch.empty(2, dtype=torch.uint64), torch.empty((), dtype=torch.uint64)
        return (out.to(q.dtype).contiguous().transpose(1, 2), lse.float().contiguous(), None, None,
                q.shape[1], k.shape[1], rng_state, unused, torch.empty(0, dtype=q.dtype))

    def flash_backward(self, grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k,
                       max_q, max_k, dropout_p, is_causal, philox_seed, philox_offset, *,
                       scale=None):
        self.calls.append(("flash_backward", query.shape[1], key.shape[1]))
        # _flash_attention_backward: a *defined* cum_seq_q selects mha_varlen_bwd
        if cum_seq_q is not None or cum_seq_k is not None:
            _require(cum_seq_q is not None and cum_seq_q.dtype == torch.int32,
                     "cu_seqlens_q must have dtype int32")
            raise RuntimeError("stand-in: the varlen path is not modelled (the dense forward "
                               "gives None)")
        _require(dropout_p == 0.0, "stand-in: dropout not modelled")
        _require(philox_seed.dtype == torch.uint64 and tuple(philox_seed.shape) == (2,)
                 and philox_offset.dtype == torch.uint64 and philox_offset.dim() == 0,
                 "philox_seed/offset must be as the flash forward returned them "
                 f"(uint64 [2], uint64 []), got {philox_seed.dtype} {tuple(philox_seed.shape)}, "
                 f"{philox_offset.dtype} {tuple(philox_offset.shape)}")
        q, k, v, o, do = _bshd(query, key, value, out, grad_out)
        _check_flash_inputs(q, k, v)
        _require(o.dtype == q.dtype and do.dtype == q.dtype,
                 "query and out/dout must have the same dtype")
        b, sq, h, _ = q.shape
        # mha_bwd passes softmax_lse.data_ptr() as a dense [B, H, S] fp32 array
        _require(logsumexp.dtype == torch.float32 and tuple(logsumexp.shape) == (b, h, sq)
                 and logsumexp.is_contiguous(),
                 f"softmax_lse must be a contiguous fp32 [{b}, {h}, {sq}], got "
                 f"{logsumexp.dtype} {tuple(logsumexp.shape)} strides {logsumexp.stride()}")
        dq, dk, dv = fp64_backward(do, q, k, v, o, logsumexp, is_causal, _scale(q, scale))
        # dense [B, S, H, d] buffers as [B, H, S, d] views; dk/dv with Hkv heads (mha_bwd
        # sums the expanded groups)
        return tuple(g.to(q.dtype).contiguous().transpose(1, 2) for g in (dq, dk, dv))

    def efficient(self, query, key, value, attn_bias, compute_log_sumexp, dropout_p=0.0,
                  is_causal=False, *, scale=None):
        self.calls.append(("efficient", query.shape[1], key.shape[1]))
        _require(dropout_p == 0.0, "stand-in: dropout not modelled")
        q, k, v = _bshd(query, key, value)
        if attn_bias is not None:
            _check_bias(attn_bias, q, k)
        _require(q.dtype in (torch.float32, *HALF), f"efficient attention: no kernel for {q.dtype}")
        _require(q.shape[2] == k.shape[2] and q.shape[2] == v.shape[2],
                 f"TORCH_CHECK(query.size(2) == key.size(2)): efficient attention wants equal "
                 f"head counts, got {q.shape[2]} and {k.shape[2]}")
        for t in (q, k, v):
            _require(t.stride(-1) == 1, "tensor must have a contiguous last dimension")
        out, lse = fp64_forward(q, k, v, is_causal, _scale(q, scale), attn_bias)
        b, sq, h, _ = q.shape
        # LSE rows padded to kAlignLSE = 32, the kernel writes only the first S (torch's rule,
        # stated here independently of usp.compat.efficient_lse_rows on purpose)
        rows = math.ceil(sq / 32) * 32 if compute_log_sumexp else 0
        lse_pad = torch.full((b, h, rows), float("nan"))
        if compute_log_sumexp:
            lse_pad[..., :sq] = lse
        # seed/offset: empty int64 scalars on the CPU (no dropout, no graph capture)
        seed, offset = torch.empty((), dtype=torch.int64), torch.empty((), dtype=torch.int64)
        return out.to(q.dtype).contiguous().transpose(1, 2), lse_pad, seed, offset

    def efficient_backward(self, grad_out_, query, key, value, attn_bias, out, logsumexp,
                           philox_seed, philox_offset, dropout_p, grad_input_mask, is_causal=False,
                           *, scale=None):
        self.calls.append(("efficient_backward", query.shape[1], key.shape[1]))
        _require(not grad_input_mask[3], "stand-in: the bias gradient is not modelled")
        _require(dropout_p == 0.0, "stand-in: dropout not modelled")
        _require(philox_seed.dtype == torch.int64 and philox_seed.numel() == 1
                 and philox_offset.dtype == torch.int64 and philox_offset.numel() == 1,
                 "philox_seed/offset must be int64 scalars as the efficient forward returned them")
        q, k, v, o, do = _bshd(query, key, value, out, grad_out_)
        b, sq, h, _ = q.shape
        if attn_bias is not None:
            _check_bias(attn_bias, q, k)
        _require(h == k.shape[2] and h == v.shape[2] and h == do.shape[2],
                 f"TORCH_CHECK(query.size(2) == key.size(2)): got {h} and {k.shape[2]} heads")
        for t in (q, k, v):
            _require(t.stride(-1) == 1, "tensor must have a contiguous last dimension")
        # kernel_backward.h: o_strideM() = head_dim_value * num_heads, only strides B/H are passed
        _require(o.stride(-1) == 1 and o.stride(1) == h * v.shape[-1],
                 f"out rows must be dense [B, S, H, d] (stride(1) == {h * v.shape[-1]}), "
                 f"got strides {o.stride()}")
        # the LSE is read by pointer with its batch and head strides only
        _require(logsumexp.dtype == torch.float32 and logsumexp.dim() == 3
                 and tuple(logsumexp.shape[:2]) == (b, h) and logsumexp.shape[2] >= sq
                 and logsumexp.stride(-1) == 1,
                 f"logsumexp must be fp32 [{b}, {h}, >= {sq}] with unit last stride, got "
                 f"{logsumexp.dtype} {tuple(logsumexp.shape)} strides {logsumexp.stride()}")
        _require(h <= 1 or logsumexp.stride(1) % 8 == 0, "LSE is not correctly aligned (strideH)")
        _require(b <= 1 or logsumexp.stride(0) % 8 == 0, "LSE is not correctly aligned (strideB)")
        dq, dk, dv = fp64_backward(do, q, k, v, o, logsumexp[..., :sq], is_causal,
                                   _scale(q, scale), attn_bias)
        # empty_permuted(..., (0, 2, 1, 3)): dense [B, S, H, d] buffers as [B, H, S, d] views
        grads = tuple(g.to(q.dtype).contiguous().transpose(1, 2) for g in (dq, dk, dv))
        return (*grads, None)
