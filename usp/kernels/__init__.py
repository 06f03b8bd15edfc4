"""Local block-attention kernels returning (out, lse), one adapter per backend.

``get_kernel(name)`` returns an object following ``usp.kernels.base.Kernel``:

- ``torch``: PyTorch's aten attention ops (``aten.py``: CPU ``_for_cpu``, CUDA flash/efficient);
- ``flash_attn``: the flash-attn package (CUDA; imported only when asked for);
- ``reference``: plain math in >= fp32, the ground truth in tests.
"""

from __future__ import annotations

import torch

from .base import Kernel
from .reference import ReferenceKernel
from .aten import TorchKernel

KERNELS = ("torch", "flash_attn", "reference")


def _kernel_class(name: str):
    if name == "torch":
        return TorchKernel
    if name == "reference":
        return ReferenceKernel
    if name == "flash_attn":
        from .flash_attn import FlashAttnKernel  # the module imports flash-attn only when built

        return FlashAttnKernel
    raise ValueError(f"unknown attention kernel {name!r}; choose one of {KERNELS}")


def get_kernel(name: str | Kernel) -> Kernel:
    if not isinstance(name, str):
        return name
    return _kernel_class(name)()


def supported_masks(kernel: str | Kernel) -> frozenset:
    """The mask kinds (``usp.masks.MASK_KINDS``) ``kernel`` applies; none for a kernel
    object that does not say."""
    cls = _kernel_class(kernel) if isinstance(kernel, str) else kernel
    return frozenset(getattr(cls, "masks", ()))


def local_attention(q, k, v, causal: bool = True, kernel: str | Kernel = "torch", scale=None,
                    segment_ids: torch.Tensor | None = None, window: int | None = None):
    """Single-process attention with autograd: q [B, L, Hq, d], k/v [B, L, Hkv, d] -> [B, L, Hq, d].

    ``segment_ids`` [B, L] long and ``window`` as in ``usp.usp_attention`` (the same plan,
    on one ring rank).
    """
    from ..masks import check_masks  # here: both import this package
    from ..ring import RingAttention, RingPlan

    check_masks(segment_ids, window, batch=q.shape[0], seq_len=q.shape[1], device=q.device,
                kernel=kernel)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    plan = RingPlan(0, 1, q.shape[1], causal, "contiguous", window, segment_ids)
    return RingAttention.apply(q, k, v, None, 0, 1, causal, "contiguous", get_kernel(kernel),
                               scale, plan)


__all__ = ["Kernel", "KERNELS", "get_kernel", "local_attention", "supported_masks"]
