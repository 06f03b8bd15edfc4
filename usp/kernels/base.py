"""The contract every local attention kernel meets.

A kernel computes attention of one query block against one key/value block and returns
the output together with the log-sum-exp (LSE) of the softmax denominator, so partial
results over several KV blocks can be merged exactly (see ``usp.ring.merge``).

Layout everywhere: ``[B, S, H, d]`` (batch, sequence, heads, head dim). GQA: ``k``/``v``
may have fewer heads than ``q``; query head ``h`` uses KV head ``h // (Hq // Hkv)``.
``causal`` is top-left aligned and is only used on square (diagonal) blocks.
"""

from __future__ import annotations

from typing import Protocol

import torch


class Kernel(Protocol):
    name: str

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q [B, S, Hq, d], k/v [B, Sk, Hkv, d] -> out [B, S, Hq, d] (q.dtype), lse [B, Hq, S] fp32."""
        ...

    def backward(
        self,
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        causal: bool,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Gradients of this block given the *final* ``out`` and ``lse`` of the rows.

        With the merged out/lse of all blocks this returns the exact block contribution:
        dq [B, S, Hq, d], dk/dv [B, Sk, Hkv, d].
        """
        ...
