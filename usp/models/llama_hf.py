"""The built-in Llama (``usp.models.decoder``, ``model.hf=None``) as a transformers model: the
architecture that computes what it computes, and where each of its weights goes.

Both are the same decoder: pre-norm RMSNorm blocks, GQA attention without biases, SwiGLU,
"rotate half" RoPE (frequency i = ``theta ** (-2i / head_dim)``, pairing i with
i + head_dim/2, as transformers' ``rotate_half``), scores scaled by ``head_dim ** -0.5``, and
a window of w tokens meaning "the query and the w - 1 tokens before it" (``usp.masks`` and
transformers' ``sliding_window`` both). So the weights move over unchanged, only renamed:

- no window on any layer -> ``LlamaForCausalLM``;
- a window on every layer -> ``MistralForCausalLM`` (its ``sliding_window``);
- a window on some layers (``full_attention_every``, ``layer_types``) or q/k/v biases
  (``qkv_bias``) -> ``Qwen2ForCausalLM`` with ``layer_types``; Qwen2 always has q/k/v
  biases, which are set to zero (an exact no-op) when the built-in model has none;
- ``model.arch`` (a run started from a checkpoint: its architecture) overrides the choice.

What differs only in rounding: usp computes RMSNorm's ``x / rms(x) * weight`` in fp32 and
casts once, transformers casts ``x / rms(x)`` before the weight multiplies; equal in fp32,
one rounding apart in bf16/fp16. RoPE angles are fp64 in usp, fp32 in transformers.
"""

from __future__ import annotations

from dataclasses import replace

from ..config import ModelConfig

# usp parameter name (inside a block) -> transformers name (inside model.layers.i)
_BLOCK = {"attention.wq.weight": "self_attn.q_proj.weight",
          "attention.wk.weight": "self_attn.k_proj.weight",
          "attention.wv.weight": "self_attn.v_proj.weight",
          "attention.wo.weight": "self_attn.o_proj.weight",
          "feed_forward.w1.weight": "mlp.gate_proj.weight",  # gate
          "feed_forward.w3.weight": "mlp.up_proj.weight",  # up
          "feed_forward.w2.weight": "mlp.down_proj.weight",  # down
          "attention_norm.weight": "input_layernorm.weight",
          "ffn_norm.weight": "post_attention_layernorm.weight"}
_BIASES = {"attention.wq.bias": "self_attn.q_proj.bias",  # with qkv_bias (Qwen2)
           "attention.wk.bias": "self_attn.k_proj.bias",
           "attention.wv.bias": "self_attn.v_proj.bias"}


def hf_equivalent(mc: ModelConfig) -> ModelConfig:
    """``mc`` (a built-in model, ``hf=None``) as the ``model.hf`` config of the transformers
    architecture that computes the same function: ``llama`` (no windowed layer),
    ``mistral`` (every layer windowed) or ``qwen2`` (some); ``mc.arch`` (a run from a
    checkpoint) keeps that architecture, whatever the windows (``ModelConfig`` refuses a
    window on a Llama and a Mistral window on some layers only).
    ``usp.models.hf_model.hf_config`` turns it into the transformers config."""
    if mc.hf is not None:
        raise ValueError(f"model.hf={mc.hf} is a transformers model already; it exports with "
                         "its own config (run_dir/hf_config), not through the built-in mapping")
    windowed = [mc.layer_window(i) is not None for i in range(mc.n_layers)]
    if mc.arch is not None:  # the checkpoint's architecture (ModelConfig checked the windows)
        if not any(windowed):
            return replace(mc, hf=mc.arch, sliding_window=None, full_attention_every=0,
                           layer_types=None)
        return replace(mc, hf=mc.arch, full_attention_every=0 if mc.arch == "mistral" else
                       mc.full_attention_every)
    if not any(windowed):
        return replace(mc, hf="llama", sliding_window=None, full_attention_every=0)
    if all(windowed):
        return replace(mc, hf="mistral", full_attention_every=0)
    return replace(mc, hf="qwen2")


def hf_names(mc: ModelConfig) -> dict[str, str]:
    """Every parameter of the built-in model (``Transformer.state_dict()`` names) -> the name
    of the same tensor in the transformers model of ``hf_equivalent(mc)``. With tied
    embeddings there is no ``output.weight``: ``lm_head.weight`` is ``embed_tokens``."""
    names = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight"}
    for i in range(mc.n_layers):
        block = {**_BLOCK, **_BIASES} if mc.qkv_bias else _BLOCK
        names.update({f"layers.{i}.{k}": f"model.layers.{i}.{v}" for k, v in block.items()})
    if not mc.tie_embeddings:
        names["output.weight"] = "lm_head.weight"
    return names


def zero_filled(mc: ModelConfig) -> list[str]:
    """The transformers weights of ``hf_equivalent(mc)`` that the built-in model lacks and
    that are exact at zero: Qwen2's q/k/v biases when the built-in model has none (none for
    Llama and Mistral)."""
    if hf_equivalent(mc).hf != "qwen2" or mc.qkv_bias:
        return []
    return [f"model.layers.{i}.{b}" for i in range(mc.n_layers) for b in _BIASES.values()]
