"""Adapter for the ``flash-attn`` package (CUDA, fp16/bf16, GQA native). Imported lazily.

The private ``_flash_attn_forward/_backward`` changed between versions (see
``usp.compat.flash_attn_ops``): 2.5 takes ``window_size``, 2.6 adds ``softcap``, 2.7+
(``torch.library.custom_op``s) take ``window_size_left/right``; the forward returns 8
values (lse at 5) before 2.7 and 4 (lse at 1) from 2.7. We call them by keyword with the
names the installed version declares, and read dq/dk/dv from the buffers we hand in,
which every version fills.

Masks: a window-only ``BlockMask`` is flash-attn's own ``window_size`` (its ``band``,
bottom-right aligned); document masks would need the varlen API and are refused
(``usp.masks.check_masks`` refuses them before any collective). Rows flash-attn leaves
without a key get LSE +inf there: ``settle_empty_rows`` sets the contract's -inf.
"""

from __future__ import annotations

import torch

from .. import compat
from .base import settle_empty_rows


def _window(mask) -> tuple[int, int]:
    if mask is None:
        return -1, -1
    if mask.band is None:
        raise ValueError("kernel='flash_attn' applies a mask only as its window_size (sliding "
                         "windows), not segment_ids (that needs flash-attn's varlen API); use "
                         "kernel='torch'")
    return mask.band


def _common_kwargs(params: frozenset, scale: float, causal: bool, mask) -> dict:
    kw = dict(dropout_p=0.0, softmax_scale=scale, causal=causal, alibi_slopes=None)
    left, right = _window(mask)
    if "window_size_left" in params:  # 2.7+
        kw.update(window_size_left=left, window_size_right=right)
    else:  # 2.5, 2.6
        kw["window_size"] = (left, right)
    if "softcap" in params:  # 2.6+
        kw["softcap"] = 0.0
    return kw


class FlashAttnKernel:
    name = "flash_attn"
    masks = frozenset({"window"})

    def __init__(self) -> None:
        self._ops = compat.flash_attn_ops()

    def forward(self, q, k, v, causal, scale, mask=None):
        """q [B, S, Hq, d], k/v [B, Sk, Hkv, d] -> out [B, S, Hq, d], lse [B, Hq, S] fp32."""
        kw = _common_kwargs(self._ops.forward_params, scale, causal, mask)
        res = self._ops.forward(q.contiguous(), k.contiguous(), v.contiguous(),
                                return_softmax=False, **kw)
        out, lse = (res[0], res[1]) if len(res) == 4 else (res[0], res[5])
        return settle_empty_rows(out, lse.float(), mask)

    def backward(self, dout, q, k, v, out, lse, causal, scale, mask=None):
        """dq [B, S, Hq, d], dk/dv [B, Sk, Hkv, d] from the rows' final ``out`` and ``lse``."""
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        kw = _common_kwargs(self._ops.backward_params, scale, causal, mask)
        self._ops.backward(dout.contiguous(), q, k, v, out.contiguous(), lse.contiguous(),
                           dq, dk, dv, deterministic=False, rng_state=None, **kw)
        return dq, dk, dv
