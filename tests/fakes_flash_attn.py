"""Stand-in ``flash_attn`` packages with each version's private ``_flash_attn_forward/_backward``.

Signatures and return arities as in ``flash_attn/flash_attn_interface.py`` at the tags
v2.5.0-v2.5.9.post1 ("2.5"), v2.6.0-v2.6.3 ("2.6") and v2.7.0-v2.8.3.post1 ("2.7", the
same in 2.8): the 2.7 ones are real ``torch.library.custom_op``s (registered for CPU here,
"cuda" upstream), so ``inspect.signature`` sees ``(*args, **kwargs)`` as it does there.
Checks: what ``flash_attn_cuda.fwd/bwd`` (csrc ``mha_fwd``/``mha_bwd``) check, plus the
no-softcap, no-dropout arguments our adapter must send. ``window_size`` (left, right) as
``mha_fwd`` reads it: -1 unbounded, a side >= Sk unbounded, ``causal`` sets right = 0;
query i sees keys i + Sk - S - left .. i + Sk - S + right (bottom-right aligned); a row
without a key gives out 0 and LSE +inf (``softmax.h``). Values: fp64 math
(``fakes_cuda_ops.fp64_forward``).
"""

from __future__ import annotations

import sys
import types
from typing import Optional

import torch

from fakes_cuda_ops import fp64_backward, fp64_forward

VERSIONS = ("2.5", "2.6", "2.7")
HALF = (torch.float16, torch.bfloat16)


def _require(ok: bool, msg: str) -> None:
    if not ok:
        raise RuntimeError(msg)


def _check(q, k, v, dropout_p, window, softcap, alibi_slopes):
    _require(q.dtype in HALF, "FlashAttention only support fp16 and bf16 data type")
    _require(k.dtype == q.dtype and v.dtype == q.dtype,
             "query and key/value must have the same dtype")
    _require(q.shape[-1] % 8 == 0, "head_size must be a multiple of 8")
    _require(q.shape[2] % k.shape[2] == 0,
             "Number of heads in key/value must divide number of heads in query")
    _require(dropout_p == 0.0 and softcap == 0.0 and alibi_slopes is None,
             f"stand-in expects no dropout/softcap/alibi, got {dropout_p}, {softcap}, "
             f"{alibi_slopes}")
    _require(all(isinstance(w, int) and w >= -1 for w in window),
             f"window_size must be ints >= -1, got {window}")


def window_visible(s: int, sk: int, left: int, right: int) -> torch.Tensor:
    """bool [S, Sk]: flash-attn's window, query i sees keys i + Sk - S - left ..
    i + Sk - S + right (bottom-right aligned; a side of -1 is unbounded)."""
    i, j = torch.arange(s)[:, None], torch.arange(sk)[None, :]
    ok = torch.ones(s, sk, dtype=torch.bool)
    if left >= 0:
        ok &= j >= i + sk - s - left
    if right >= 0:
        ok &= j <= i + sk - s + right
    return ok


def _window_bias(q, k, causal, window):
    """Additive [1, 1, S, Sk] bias of flash-attn's window (None: no window, no causal)."""
    s, sk = q.shape[1], k.shape[1]
    left, right = window
    left = -1 if left >= sk else left
    right = 0 if causal else (-1 if right >= sk else right)
    if left < 0 and right < 0:
        return None
    ok = window_visible(s, sk, left, right)
    return torch.zeros(1, 1, s, sk, dtype=torch.float64).masked_fill(~ok, float("-inf"))


def _forward(q, k, v, dropout_p, scale, causal, window, softcap, alibi_slopes, return_softmax):
    """(out [B, S, Hq, d], lse [B, Hq, S] fp32) in fp64 math."""
    _check(q, k, v, dropout_p, window, softcap, alibi_slopes)
    _require(not return_softmax, "stand-in: return_softmax not modelled")
    bias = _window_bias(q, k, causal, window)
    out, lse = fp64_forward(q, k, v, causal and bias is None, scale, bias)
    empty = lse == float("-inf")  # [B, H, S]: rows without a key
    out = out.masked_fill(empty.transpose(1, 2)[..., None], 0.0)
    return out.to(q.dtype), lse.masked_fill(empty, float("inf")).float()


def _backward(dout, q, k, v, out, lse, dq, dk, dv, dropout_p, scale, causal, window, softcap,
              alibi_slopes):
    """Writes dq/dk/dv in place, as flash_attn_cuda.bwd does; returns softmax_d."""
    _check(q, k, v, dropout_p, window, softcap, alibi_slopes)
    b, s, h, _ = q.shape
    _require(lse.dtype == torch.float32 and tuple(lse.shape) == (b, h, s) and lse.is_contiguous(),
             f"softmax_lse must be a contiguous fp32 [{b}, {h}, {s}], got {lse.dtype} "
             f"{tuple(lse.shape)} strides {lse.stride()}")
    for buf, like in ((dq, q), (dk, k), (dv, v)):
        _require(buf.dtype == q.dtype and buf.shape == like.shape and buf.stride(-1) == 1,
                 f"dq/dk/dv must match q/k/v ({tuple(like.shape)}), got {tuple(buf.shape)}")
    bias = _window_bias(q, k, causal, window)
    grads = fp64_backward(dout, q, k, v, out, lse, causal and bias is None, scale, bias)
    for buf, g in zip((dq, dk, dv), grads):
        buf.copy_(g)
    return ((dout.double() * out.double()).sum(-1).transpose(1, 2)).float()  # softmax_d [B, H, S]


def _empty():
    return torch.empty(0)


# ---- 2.5: window_size tuple, no softcap; forward returns 8 values (lse at 5) --------------


def _fwd_25(q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes, return_softmax):
    out, lse = _forward(q, k, v, dropout_p, softmax_scale, causal, window_size, 0.0, alibi_slopes,
                        return_softmax)
    return out, q, k, v, out, lse, None, _empty()


def _bwd_25(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
            window_size, alibi_slopes, deterministic, rng_state=None):
    d = _backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
                  window_size, 0.0, alibi_slopes)
    return dq, dk, dv, d


# ---- 2.6: softcap after window_size; same returns ------------------------------------------


def _fwd_26(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
            return_softmax):
    out, lse = _forward(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                        alibi_slopes, return_softmax)
    return out, q, k, v, out, lse, None, _empty()


def _bwd_26(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
            window_size, softcap, alibi_slopes, deterministic, rng_state=None):
    d = _backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
                  window_size, softcap, alibi_slopes)
    return dq, dk, dv, d


# ---- 2.7+: custom ops, window_size_left/right; forward returns 4, backward softmax_d -----


@torch.library.custom_op("usp_fake_flash_attn27::_flash_attn_forward", mutates_args=(),
                         device_types="cpu")
def _fwd_27(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int,
    window_size_right: int,
    softcap: float,
    alibi_slopes: Optional[torch.Tensor],
    return_softmax: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    window = (window_size_left, window_size_right)
    out, lse = _forward(q, k, v, dropout_p, softmax_scale, causal, window, softcap, alibi_slopes,
                        return_softmax)
    return out, lse, _empty(), _empty()


@torch.library.custom_op("usp_fake_flash_attn27::_flash_attn_backward",
                         mutates_args=("dq", "dk", "dv"), device_types="cpu")
def _bwd_27(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    softmax_lse: torch.Tensor,
    dq: Optional[torch.Tensor],
    dk: Optional[torch.Tensor],
    dv: Optional[torch.Tensor],
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int,
    window_size_right: int,
    softcap: float,
    alibi_slopes: Optional[torch.Tensor],
    deterministic: bool,
    rng_state: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    return _backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
                     (window_size_left, window_size_right), softcap, alibi_slopes)


_OPS = {"2.5": (_fwd_25, _bwd_25), "2.6": (_fwd_26, _bwd_26), "2.7": (_fwd_27, _bwd_27)}


def install(monkeypatch, version: str) -> None:
    """Make ``from flash_attn import flash_attn_interface`` give this version's stand-in."""
    iface = types.ModuleType("flash_attn.flash_attn_interface")
    iface._flash_attn_forward, iface._flash_attn_backward = _OPS[version]
    pkg = types.ModuleType("flash_attn")
    pkg.__version__ = version
    pkg.flash_attn_interface = iface
    monkeypatch.setitem(sys.modules, "flash_attn", pkg)
    monkeypatch.setitem(sys.modules, "flash_attn.flash_attn_interface", iface)
