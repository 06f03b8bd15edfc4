"""Gemma 3's weights are the shared decoder's (``usp.models.family.decoder_names``) with its
q and k norms, and four norms a block: the pre-MLP norm is the shared ``ffn_norm`` (which a
Llama calls ``post_attention_layernorm``), and the norms of each part's output are Gemma's own
(``usp.models.gemma3_text.model.GemmaBlock``)."""

from __future__ import annotations

from ..family import QK_NORMS, decoder_names

# built-in parameter (inside a block) -> transformers name (inside model.layers.i)
BLOCK_NORMS = {"ffn_norm.weight": "pre_feedforward_layernorm.weight",
               "post_attention_norm.weight": "post_attention_layernorm.weight",
               "post_ffn_norm.weight": "post_feedforward_layernorm.weight"}


def names(mc) -> dict[str, str]:
    """Every parameter of the built-in Gemma 3 of ``mc`` -> its name in a
    ``Gemma3ForCausalLM``."""
    out = decoder_names(mc)
    for i in range(mc.n_layers):
        out.update({f"layers.{i}.{k}": f"model.layers.{i}.{v}"
                    for k, v in {**QK_NORMS, **BLOCK_NORMS}.items()})
    return out
