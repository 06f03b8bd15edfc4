"""Qwen3's weights are the shared decoder's (``usp.models.family.decoder_names``) plus each
layer's q and k norm, a [head_dim] weight each."""

from __future__ import annotations

from ..family import QK_NORMS, decoder_names


def names(mc) -> dict[str, str]:
    """Every parameter of the built-in model of ``mc`` (``qk_norm``) -> its name in a
    ``Qwen3ForCausalLM``."""
    out = decoder_names(mc)
    for i in range(mc.n_layers):
        out.update({f"layers.{i}.{k}": f"model.layers.{i}.{v}" for k, v in QK_NORMS.items()})
    return out
