"""What a gpt-oss checkpoint's config says of its shape, and what ``model.hf=gpt_oss``
refuses."""

from __future__ import annotations

from ..family import (active_ffn, from_checkpoint, read_layer_windows, refuse_router_loss,
                      shape_fields)


def read(hc) -> dict:
    """``ModelConfig`` fields of a ``GptOssConfig``: biases, the band on its sliding layers,
    YaRN, and as ``ffn_dim`` the experts a token runs (``active_ffn``)."""
    return {**shape_fields(hc), "qkv_bias": True, **read_layer_windows(hc),
            "ffn_dim": active_ffn(hc, hc.intermediate_size)}


def check_hf(mc) -> None:
    """``model.hf=gpt_oss`` starts from a checkpoint and trains without a router loss."""
    from_checkpoint(mc, "gpt_oss", "experts, sinks and router")
    refuse_router_loss(mc)
