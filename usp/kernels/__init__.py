"""Local block-attention kernels returning (out, lse), one adapter per backend.

``get_kernel(name)`` returns an object following ``usp.kernels.base.Kernel``:

- ``torch``: PyTorch's aten attention ops (``aten.py``: CPU ``_for_cpu``, CUDA flash/efficient);
- ``flash_attn``: the flash-attn package (CUDA; imported only when asked for);
- ``reference``: plain math in >= fp32, the ground truth in tests.
"""

from __future__ import annotations

from ..rules import KERNELS  # the names the rules know
from .aten import TorchKernel
from .base import Kernel
from .reference import ReferenceKernel


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


__all__ = ["Kernel", "KERNELS", "get_kernel", "supported_masks"]
