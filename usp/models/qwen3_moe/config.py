"""What a Qwen3-MoE checkpoint's config says of its shape, and what ``model.hf=qwen3_moe``
refuses."""

from __future__ import annotations

from ..family import (active_ffn, from_checkpoint, read_layer_windows, refuse_router_loss,
                      shape_fields)


def read(hc) -> dict:
    """``ModelConfig`` fields of a ``Qwen3MoeConfig``: q/k norms, its windows, and as
    ``ffn_dim`` the experts a token runs in a sparse layer (``active_ffn``)."""
    refuse_router_loss(hc)
    return {**shape_fields(hc), "qk_norm": True, **read_layer_windows(hc),
            "ffn_dim": active_ffn(hc, hc.moe_intermediate_size)}


def check_hf(mc) -> None:
    """``model.hf=qwen3_moe`` starts from a checkpoint."""
    from_checkpoint(mc, "qwen3_moe", "experts and router")
