"""A mixture-of-experts block (``usp.models.moe.MoeBlock``) as a decoder layer's MLP.

``SparseMlp`` is mixed in before a family's block class (``class Qwen3SparseMlp(SparseMlp,
Qwen3MoeBlock)``): x [B, n, D] -> y [B, n, D] over ``tiles`` sequence tiles (``model.mlp_tiles``;
each tile routed on its own: the same experts and weights per token, recomputed in backward),
the block's router statistics handed to the block's ``ledger`` when it has one (the
router's load-balancing loss, ``usp.models.router_loss``) and dropped otherwise.
"""

from __future__ import annotations

import torch

from .tiling import tiled


class SparseMlp:
    """Mixin for a ``MoeBlock`` subclass: the decoder-MLP ``forward`` (set ``tiles``)."""

    tiles: int = 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return tiled(self._routed, x, self.tiles)

    def _routed(self, x: torch.Tensor) -> torch.Tensor:
        y, _stats = super().forward(x)  # [B, n, D] -> [B, n, D], the block's RouterStats
        return y
