"""What a Gemma 3 text checkpoint's config says of its shape, and what
``model.hf=gemma3_text`` refuses."""

from __future__ import annotations

from ..family import from_checkpoint, read_layer_windows, shape_fields


def read(hc) -> dict:
    """``ModelConfig`` fields of a ``Gemma3TextConfig``: q/k norms, its windows (local
    layers), RoPE as its full-attention layers have it (``shape_fields``); bidirectional
    attention (``use_bidirectional_attention``, an encoder's) is refused."""
    if getattr(hc, "use_bidirectional_attention", False):
        raise ValueError("use_bidirectional_attention=true: every token attends to the whole "
                         "sequence, both ways; usp trains causal decoders (set it false)")
    return {**shape_fields(hc), "qk_norm": True, **read_layer_windows(hc)}


def check_hf(mc) -> None:
    """``model.hf=gemma3_text`` starts from a checkpoint."""
    from_checkpoint(mc, "gemma3_text", "norms around each block, embedding scale and "
                    "attention scale")
