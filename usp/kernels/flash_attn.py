"""Adapter for the ``flash-attn`` package (CUDA, fp16/bf16). Imported lazily.

flash-attn changed the private ``_flash_attn_forward/_backward`` signatures between
2.5 (``window_size`` tuple, 8 return values) and 2.6+ (``window_size_left/right``,
``softcap``, 4 return values). We call them by keyword, picking the names the installed
version has: this file is the only place that knows.
"""

from __future__ import annotations

import inspect

import torch


def _import():
    try:
        from flash_attn import flash_attn_interface as fai
    except ImportError as e:  # pragma: no cover - depends on the machine
        raise ImportError(
            "kernel='flash_attn' needs the flash-attn package (CUDA only): "
            "pip install 'usp[gpu]', or use kernel='torch'"
        ) from e
    return fai


def _window_kwargs(params) -> dict:
    if "window_size_left" in params:
        kw = {"window_size_left": -1, "window_size_right": -1}
    else:
        kw = {"window_size": (-1, -1)}
    if "softcap" in params:
        kw["softcap"] = 0.0
    return kw


class FlashAttnKernel:
    name = "flash_attn"

    def __init__(self) -> None:
        fai = _import()
        self._fwd, self._bwd = fai._flash_attn_forward, fai._flash_attn_backward
        self._fwd_params = set(inspect.signature(self._fwd).parameters)
        self._bwd_params = set(inspect.signature(self._bwd).parameters)

    def forward(self, q, k, v, causal, scale):
        kw = dict(dropout_p=0.0, softmax_scale=scale, causal=causal, alibi_slopes=None,
                  return_softmax=False, **_window_kwargs(self._fwd_params))
        res = self._fwd(q.contiguous(), k.contiguous(), v.contiguous(), **kw)
        out, lse = (res[0], res[1]) if len(res) == 4 else (res[0], res[5])
        return out, lse.float()

    def backward(self, dout, q, k, v, out, lse, causal, scale):
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        kw = dict(dropout_p=0.0, softmax_scale=scale, causal=causal, alibi_slopes=None,
                  deterministic=False, rng_state=None, **_window_kwargs(self._bwd_params))
        kw = {k_: v_ for k_, v_ in kw.items() if k_ in self._bwd_params}
        self._bwd(dout.contiguous(), q.contiguous(), k.contiguous(), v.contiguous(),
                  out.contiguous(), lse.contiguous(), dq, dk, dv, **kw)
        return dq, dk, dv
