"""Adapter for PyTorch's own flash-attention ops that return the LSE.

CPU: ``aten._scaled_dot_product_flash_attention_for_cpu`` (+ ``_backward``), GQA native.
CUDA: ``aten._scaled_dot_product_flash_attention`` for fp16/bf16 and
``aten._scaled_dot_product_efficient_attention`` for fp32; KV heads are expanded for
GQA because those ops want equal head counts. Every aten-signature quirk lives here.
"""

from __future__ import annotations

import torch

aten = torch.ops.aten


def _bhsd(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(1, 2)  # [B, S, H, d] <-> [B, H, S, d] (a view)


def _expand(x: torch.Tensor, groups: int) -> torch.Tensor:
    return x if groups == 1 else x.repeat_interleave(groups, dim=2)


def _fold(dx: torch.Tensor, groups: int) -> torch.Tensor:
    if groups == 1:
        return dx
    b, s, h, d = dx.shape
    return dx.view(b, s, h // groups, groups, d).sum(3)


class TorchKernel:
    name = "torch"

    def forward(self, q, k, v, causal, scale):
        if q.device.type == "cpu":
            out, lse = aten._scaled_dot_product_flash_attention_for_cpu(
                _bhsd(q), _bhsd(k), _bhsd(v), 0.0, causal, scale=scale
            )
            return _bhsd(out), lse
        g = q.shape[2] // k.shape[2]
        k, v = _expand(k, g), _expand(v, g)
        if q.dtype in (torch.float16, torch.bfloat16):
            res = aten._scaled_dot_product_flash_attention(
                _bhsd(q), _bhsd(k), _bhsd(v), 0.0, causal, False, scale=scale
            )
            out, lse = res[0], res[1]
        else:
            out, lse, _, _ = aten._scaled_dot_product_efficient_attention(
                _bhsd(q), _bhsd(k), _bhsd(v), None, True, 0.0, causal, scale=scale
            )
        return _bhsd(out), lse[..., : q.shape[1]].float()

    def backward(self, dout, q, k, v, out, lse, causal, scale):
        if q.device.type == "cpu":
            dq, dk, dv = aten._scaled_dot_product_flash_attention_for_cpu_backward(
                _bhsd(dout), _bhsd(q), _bhsd(k), _bhsd(v), _bhsd(out), lse.contiguous(),
                0.0, causal, scale=scale,
            )
            return _bhsd(dq), _bhsd(dk), _bhsd(dv)
        g = q.shape[2] // k.shape[2]
        ke, ve = _expand(k, g), _expand(v, g)
        sq, sk = q.shape[1], k.shape[1]
        if q.dtype in (torch.float16, torch.bfloat16):
            empty = torch.empty(0, device=q.device)
            dq, dk, dv = aten._scaled_dot_product_flash_attention_backward(
                _bhsd(dout), _bhsd(q), _bhsd(ke), _bhsd(ve), _bhsd(out),
                lse.contiguous(), empty, empty, sq, sk, 0.0, causal,
                torch.zeros(2, dtype=torch.int64, device=q.device), empty, scale=scale,
            )
        else:
            zero = torch.zeros((), dtype=torch.int64, device=q.device)
            # the efficient kernel's LSE is padded to a multiple of 32 rows; give it back so
            pad = (-sq) % 32
            lse_in = torch.nn.functional.pad(lse, (0, pad)) if pad else lse
            dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
                _bhsd(dout), _bhsd(q), _bhsd(ke), _bhsd(ve), None, _bhsd(out),
                lse_in.contiguous(), zero, zero, 0.0, [True, True, True, False], causal,
                scale=scale,
            )
        return _bhsd(dq), _fold(_bhsd(dk), g), _fold(_bhsd(dv), g)
