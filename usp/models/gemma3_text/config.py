"""The transformers config a Gemma 3 text model (``Gemma3TextConfig``) reads and writes: q/k
norms, a window on its local layers (``layer_types``), a RoPE per layer type
(``rope_parameters`` keyed ``full_attention`` / ``sliding_attention``), its attention scale
(``query_pre_attn_scalar``); what it refuses.

transformers stores ``attn_logit_softcapping`` but passes it to no attention function (5.25),
so it changes nothing and is neither read nor written; ``final_logit_softcapping`` it does
apply to the logits, which the built-in model does not (refused: ``check_builtin``)."""

from __future__ import annotations

from ...config.rope import rope_parameters
from ..family import (local_rope_theta, read_layer_windows, refuse_biases, shape_fields,
                      type_rope)

ACTIVATION = "gelu_pytorch_tanh"  # the built-in Gemma's GeGLU (usp.models.gemma3_text.model)
# what the refusal of what the built-in model does not compute says to do
HF_FIX = ("train this checkpoint with model.hf=gemma3_text (transformers' class through usp's "
          "attention)")


def read(hc) -> dict:
    """``ModelConfig`` fields of a ``Gemma3TextConfig``: q/k norms, its windows (local
    layers), RoPE as its full-attention layers have it (``shape_fields``) and the base of its
    sliding ones (``local_rope_theta``), its attention scale; bidirectional attention
    (``use_bidirectional_attention``, an encoder's) is refused."""
    if getattr(hc, "use_bidirectional_attention", False):
        raise ValueError("use_bidirectional_attention=true: every token attends to the whole "
                         "sequence, both ways; usp trains causal decoders (set it false)")
    return {**shape_fields(hc), "qk_norm": True, **read_layer_windows(hc),
            "local_rope_theta": local_rope_theta(hc),
            "query_pre_attn_scalar": hc.query_pre_attn_scalar}


def check_builtin(hc, fix: str = HF_FIX) -> None:
    """What a Gemma 3 text checkpoint may hold that transformers computes and the built-in
    model does not: capped final logits, biases, another MLP activation, scaled RoPE on the
    sliding layers. Each is refused naming the key and ``fix`` (by default
    ``model.hf=gemma3_text``)."""
    local = type_rope(hc, "sliding_attention")
    for key, value, fine in (
            ("final_logit_softcapping", getattr(hc, "final_logit_softcapping", None), None),
            ("attention_bias", getattr(hc, "attention_bias", False), False),
            ("hidden_activation", getattr(hc, "hidden_activation", ACTIVATION), ACTIVATION),
            ("rope_parameters.sliding_attention.rope_type",
             local.get("rope_type", "default"), "default")):
        if value != fine:
            raise ValueError(f"{key}={value!r}: the built-in Gemma 3 computes {key}={fine!r} "
                             f"only; {fix}")


def write(mc) -> dict:
    """The ``Gemma3TextConfig`` keywords of ``mc``: each layer's type (``layer_types``), the
    RoPE of each type (``ModelConfig.type_rope``), the attention scale (head_dim's when
    ``query_pre_attn_scalar`` is unset), no bias, GeGLU. Without a window the config keeps
    its class's ``sliding_window``, which no layer then uses (transformers builds the
    sliding mask whatever ``layer_types`` say, and needs one)."""
    kw = dict(layer_types=["full_attention" if mc.layer_window(i) is None
                           else "sliding_attention" for i in range(mc.n_layers)],
              rope_parameters={kind: rope_parameters(*mc.type_rope(kind == "sliding_attention"))
                               for kind in ("full_attention", "sliding_attention")},
              query_pre_attn_scalar=mc.query_pre_attn_scalar or mc.head_dim,
              attention_bias=False, hidden_activation=ACTIVATION)
    if mc.sliding_window is not None:
        kw["sliding_window"] = mc.sliding_window
    return kw


def check_arch(mc) -> None:
    """A run from a Gemma 3 text checkpoint has no q/k/v biases (its norms: ``families``)."""
    refuse_biases(mc, "gemma3_text")
