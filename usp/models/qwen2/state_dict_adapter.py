"""Qwen2's weights are the shared decoder's (``usp.models.family.decoder_names``) plus q/k/v
biases, which a built-in model without ``qkv_bias`` exports as zeros (an exact no-op)."""

from __future__ import annotations

from ..family import QKV_BIASES


def zero_filled(mc) -> list[str]:
    """The ``Qwen2ForCausalLM`` weights the built-in model of ``mc`` lacks: its q/k/v biases
    when ``mc.qkv_bias`` is off (none otherwise)."""
    if mc.qkv_bias:
        return []
    return [f"model.layers.{i}.{b}" for i in range(mc.n_layers) for b in QKV_BIASES.values()]
