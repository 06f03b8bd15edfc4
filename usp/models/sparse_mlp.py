"""A mixture-of-experts block (``usp.models.moe.MoeBlock``) as a decoder layer's MLP.

``SparseMlp`` is mixed in before a family's block class (``class Qwen3SparseMlp(SparseMlp,
Qwen3MoeBlock)``): x [B, n, D] -> y [B, n, D] over ``tiles`` sequence tiles (``model.mlp_tiles``;
each tile routed on its own: the same experts and weights per token, recomputed in backward).
The block's router statistics go to the model's ``RouterLedger`` once ``attach_ledger`` gave
it one (the router's load-balancing loss and the expert load, ``usp.models.router_loss``),
and are dropped otherwise.
"""

from __future__ import annotations

import torch

from .router_loss import RouterLedger, inject
from .tiling import tiled


class SparseMlp:
    """Mixin for a ``MoeBlock`` subclass: the decoder-MLP ``forward`` (set ``tiles``)."""

    tiles: int = 1
    ledger: RouterLedger | None = None
    layer: int = 0  # which decoder layer (the ledger's key)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return tiled(self._routed, x, self.tiles)

    def _routed(self, x: torch.Tensor) -> torch.Tensor:
        y, stats = super().forward(x)  # [B, n, D] -> [B, n, D], the block's RouterStats
        return y if self.ledger is None else inject(y, stats, self.ledger, self.layer)


def attach_ledger(model) -> RouterLedger | None:
    """One ``RouterLedger`` for every sparse MLP of the built-in ``model`` (its
    ``layers[i].feed_forward``), or None when it has none (a dense model, a transformers
    one)."""
    sparse = [(i, block.feed_forward) for i, block in enumerate(getattr(model, "layers", ()))
              if isinstance(getattr(block, "feed_forward", None), SparseMlp)]
    if not sparse:
        return None
    ledger = RouterLedger(sparse[0][1].n_experts)
    for i, mlp in sparse:
        mlp.ledger, mlp.layer = ledger, i
    return ledger
