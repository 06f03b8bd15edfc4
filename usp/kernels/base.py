"""The contract every local attention kernel meets.

A kernel computes attention of one query block against one key/value block and returns
the output together with the log-sum-exp (LSE) of the softmax denominator, so partial
results over several KV blocks can be merged exactly (see ``usp.ring.merge``).

Layout everywhere: ``[B, S, H, d]`` (batch, sequence, heads, head dim). GQA: ``k``/``v``
may have fewer heads than ``q``; query head ``h`` uses KV head ``h // (Hq // Hkv)``.
``causal`` is top-left aligned and is only used on square (diagonal) blocks.

Masks: ``mask`` is a ``usp.masks.BlockMask`` (or None: every pair visible), given only to
kernels whose ``masks`` names what it carries ("window": positions only, "segment_ids":
documents too). A query row that sees no key in the block returns out 0 and LSE -inf
(``settle_empty_rows``), so merging it changes nothing.
"""

from __future__ import annotations

from typing import Protocol

import torch


class BlockMask(Protocol):
    """What a kernel reads of ``usp.masks.BlockMask`` (the masks layer sits above the
    kernels, so they know it by this shape only)."""

    band: tuple[int, int] | None  # (lo, hi) key offsets of a band, when the mask is one

    def additive(self, dtype: torch.dtype, device) -> torch.Tensor: ...  # [B|1, 1, S, Sk]

    def visible(self, device) -> torch.Tensor: ...  # bool [B|1, S, Sk]

    def empty_rows(self, device) -> torch.Tensor | None: ...  # bool [B|1, S], or None


class Kernel(Protocol):
    name: str
    masks: frozenset  # the mask kinds it applies: subset of usp.masks.MASK_KINDS

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
        mask: BlockMask | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q [B, S, Hq, d], k/v [B, Sk, Hkv, d] -> out [B, S, Hq, d] (q.dtype), lse [B, Hq, S]
        fp32."""
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
        mask: BlockMask | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Gradients of this block given the *final* ``out`` and ``lse`` of the rows.

        With the merged out/lse of all blocks this returns the exact block contribution:
        dq [B, S, Hq, d], dk/dv [B, Sk, Hkv, d].
        """
        ...


def settle_empty_rows(out: torch.Tensor, lse: torch.Tensor, mask: BlockMask | None):
    """out [B, S, H, d], lse [B, H, S] with the rows ``mask`` leaves without a key set to
    0 and -inf, whatever the backend wrote there (0, NaN; LSE 0 or +inf)."""
    rows = None if mask is None else mask.empty_rows(out.device)  # [B or 1, S]
    if rows is None:
        return out, lse
    return (out.masked_fill(rows[:, :, None, None], 0.0),
            lse.masked_fill(rows[:, None, :], float("-inf")))
