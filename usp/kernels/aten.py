"""Adapter for PyTorch's own fused attention ops that return the LSE.

CPU: ``aten._scaled_dot_product_flash_attention_for_cpu`` (+ backward), GQA native.
CUDA, fp16/bf16: ``aten._scaled_dot_product_flash_attention`` (+ backward), GQA native:
K/V go in with their Hkv heads and dK/dV come back with Hkv heads.
CUDA, fp32, and any dtype with a mask: ``aten._scaled_dot_product_efficient_attention``
(+ backward), which wants equal head counts (K/V are expanded to Hq heads and dK/dV folded
back) and takes the mask as an additive ``attn_bias`` [B, Hq, S, Sk] in q's dtype whose
rows start 16-element aligned (as ``scaled_dot_product_attention`` pads it).
Masks on CPU: the ``_for_cpu`` ops' ``attn_mask``, additive in q's dtype (they refuse a
boolean one), broadcast over heads. Rows a mask leaves empty come back from the CPU op with
LSE 0: ``settle_empty_rows`` sets the contract's 0 / -inf.
The ops come from ``usp.compat``; how to call them lives here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import compat
from .base import settle_empty_rows

BIAS_ALIGN = 16  # elements: the efficient kernel reads attn_bias rows at aligned strides


def _bhsd(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(1, 2)  # [B, S, H, d] <-> [B, H, S, d] (a view)


def _expand(x: torch.Tensor, groups: int) -> torch.Tensor:
    # [B, Sk, Hkv, d] -> [B, Sk, Hkv * groups, d]
    return x if groups == 1 else x.repeat_interleave(groups, dim=2)


def _dense_rows(x: torch.Tensor) -> torch.Tensor:
    # the efficient backward takes out's row stride to be H * d without checking it
    h, d = x.shape[2:]
    return x if x.stride(3) == 1 and x.stride(1) == h * d else x.contiguous()


def _fold(dx: torch.Tensor, groups: int) -> torch.Tensor:
    if groups == 1:
        return dx
    b, s, h, d = dx.shape
    return dx.view(b, s, h // groups, groups, d).sum(3)  # [B, Sk, Hq, d] -> [B, Sk, Hkv, d]


def _bias(mask, q: torch.Tensor) -> torch.Tensor | None:
    """The efficient op's attn_bias: [B|1, 1, S, Sk] additive -> [B, Hq, S, Sk], each row
    starting at a multiple of ``BIAS_ALIGN`` elements (a padded buffer, sliced)."""
    if mask is None:
        return None
    bias = mask.additive(q.dtype, q.device)
    n = bias.shape[-1]
    bias = F.pad(bias, (0, -n % BIAS_ALIGN))[..., :n]
    return bias.expand(q.shape[0], q.shape[2], bias.shape[2], n)


class TorchKernel:
    """The ``torch`` kernel: PyTorch's fused attention ops, per device and dtype.

    ``cuda_ops``: the CUDA ops to call (default ``usp.compat.cuda_sdpa_ops()``). When given,
    the CUDA branch runs for tensors on any device: the test seam that runs it on CPU
    tensors against stand-ins enforcing the real ops' contracts.
    """

    name = "torch"
    masks = frozenset({"window", "segment_ids"})

    def __init__(self, cuda_ops: compat.CudaSdpaOps | None = None) -> None:
        self._forced = cuda_ops is not None
        self.cuda_ops = cuda_ops if cuda_ops is not None else compat.cuda_sdpa_ops()

    def _cpu(self, q: torch.Tensor) -> bool:
        return q.device.type == "cpu" and not self._forced

    def _flash(self, q, mask) -> bool:
        return q.dtype in (torch.float16, torch.bfloat16) and mask is None

    def forward(self, q, k, v, causal, scale, mask=None):
        """q [B, S, Hq, d], k/v [B, Sk, Hkv, d] -> out [B, S, Hq, d], lse [B, Hq, S] fp32."""
        if self._cpu(q):
            am = None if mask is None else mask.additive(q.dtype, q.device)  # [B|1, 1, S, Sk]
            out, lse = compat.cpu_flash_ops()[0](
                _bhsd(q), _bhsd(k), _bhsd(v), 0.0, causal, attn_mask=am, scale=scale
            )
            return settle_empty_rows(_bhsd(out), lse, mask)
        ops, sq = self.cuda_ops, q.shape[1]
        if self._flash(q, mask):
            res = ops.flash(_bhsd(q), _bhsd(k), _bhsd(v), 0.0, causal, False, scale=scale)
            out, lse = res[0], res[1]  # lse [B, Hq, S] fp32
        else:
            g = q.shape[2] // k.shape[2]
            res = ops.efficient(_bhsd(q), _bhsd(_expand(k, g)), _bhsd(_expand(v, g)),
                                _bias(mask, q), True, 0.0, causal, scale=scale)
            out, lse = res[0], res[1][..., :sq]  # [B, Hq, pad32(S)] -> [B, Hq, S]
        return settle_empty_rows(_bhsd(out), lse.float(), mask)

    def backward(self, dout, q, k, v, out, lse, causal, scale, mask=None):
        """dq [B, S, Hq, d], dk/dv [B, Sk, Hkv, d] from the rows' final ``out`` and ``lse``."""
        if self._cpu(q):
            am = None if mask is None else mask.additive(q.dtype, q.device)
            dq, dk, dv = compat.cpu_flash_ops()[1](
                _bhsd(dout), _bhsd(q), _bhsd(k), _bhsd(v), _bhsd(out), lse.contiguous(),
                0.0, causal, attn_mask=am, scale=scale,
            )
            return _bhsd(dq), _bhsd(dk), _bhsd(dv)
        ops, sq, sk = self.cuda_ops, q.shape[1], k.shape[1]
        if self._flash(q, mask):
            # cum_seq None = the dense path (a defined tensor, even 0-element, means varlen);
            # seed/offset as the no-dropout forward returned them (see compat)
            seed, offset = compat.flash_rng_placeholders(q.device)
            dq, dk, dv = ops.flash_backward(
                _bhsd(dout), _bhsd(q), _bhsd(k), _bhsd(v), _bhsd(out), lse.contiguous(),
                None, None, sq, sk, 0.0, causal, seed, offset, scale=scale,
            )
            return _bhsd(dq), _bhsd(dk), _bhsd(dv)
        g = q.shape[2] // k.shape[2]
        seed, offset = compat.efficient_rng_placeholders()
        # give the LSE back padded as the forward made it: [B, Hq, S] -> [B, Hq, pad32(S)]
        lse_in = F.pad(lse, (0, compat.efficient_lse_rows(sq) - sq)).contiguous()
        dq, dk, dv, _ = ops.efficient_backward(
            _bhsd(dout), _bhsd(q), _bhsd(_expand(k, g)), _bhsd(_expand(v, g)), _bias(mask, q),
            _bhsd(_dense_rows(out)), lse_in, seed, offset, 0.0, [True, True, True, False], causal,
            scale=scale,
        )
        return _bhsd(dq), _fold(_bhsd(dk), g), _fold(_bhsd(dv), g)
