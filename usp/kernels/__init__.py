"""Local block-attention kernels returning (out, lse), one adapter per backend.

``get_kernel(name)`` returns an object following ``usp.kernels.base.Kernel``:

- ``torch``: PyTorch's aten flash-attention ops (``aten.py``) (CPU ``_for_cpu`` ops, CUDA flash/efficient);
- ``flash_attn``: the flash-attn package (CUDA; imported only when asked for);
- ``reference``: plain math in >= fp32, the ground truth in tests.
"""

from __future__ import annotations

import torch

from .base import Kernel
from .reference import ReferenceKernel
from .aten import TorchKernel

KERNELS = ("torch", "flash_attn", "reference")


def get_kernel(name: str | Kernel) -> Kernel:
    if not isinstance(name, str):
        return name
    if name == "torch":
        return TorchKernel()
    if name == "reference":
        return ReferenceKernel()
    if name == "flash_attn":
        from .flash_attn import FlashAttnKernel

        return FlashAttnKernel()
    raise ValueError(f"unknown attention kernel {name!r}; choose one of {KERNELS}")


class _LocalAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, kernel, causal, scale):
        out, lse = kernel.forward(q, k, v, causal, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.kernel, ctx.causal, ctx.scale = kernel, causal, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ctx.kernel.backward(dout, q, k, v, out, lse, ctx.causal, ctx.scale)
        return dq, dk, dv, None, None, None


def local_attention(q, k, v, causal: bool = True, kernel: str | Kernel = "torch", scale=None):
    """Single-process attention with autograd: q [B, L, Hq, d], k/v [B, L, Hkv, d] -> [B, L, Hq, d]."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return _LocalAttention.apply(q, k, v, get_kernel(kernel), causal, scale)


__all__ = ["Kernel", "KERNELS", "get_kernel", "local_attention"]
