"""The transformers config a gpt-oss (``GptOssConfig``) reads and writes: biases on q, k, v and
o_proj (``attention_bias``), learned attention sinks on every layer, a band on its sliding
layers (``layer_types``), YaRN, and on every layer a mixture of experts (``num_local_experts``
clamped GLU experts of ``intermediate_size`` with biases, ``num_experts_per_tok`` a token,
``swiglu_limit``, ``swiglu_alpha``); what it refuses."""

from __future__ import annotations

from ..family import (from_checkpoint, read_layer_windows, refuse_router_loss, shape_fields,
                      write_layer_windows)


def read(hc) -> dict:
    """``ModelConfig`` fields of a ``GptOssConfig``: q/k/v and o_proj biases (both from
    ``attention_bias``), sinks, the band on its sliding layers, YaRN, its experts on every
    layer, and as ``ffn_dim`` the experts' width a token runs (``num_experts_per_tok`` x
    ``intermediate_size``: what a dense layer's FLOPs would count; the built-in model has no
    dense MLP)."""
    bias = bool(getattr(hc, "attention_bias", True))
    return {**shape_fields(hc), "qkv_bias": bias, "o_bias": bias, "attention_sinks": True,
            **read_layer_windows(hc), "ffn_dim": hc.intermediate_size * hc.num_experts_per_tok,
            "n_experts": hc.num_local_experts, "experts_per_token": hc.num_experts_per_tok,
            "expert_ffn_dim": hc.intermediate_size,
            "swiglu_limit": float(hc.swiglu_limit),
            "swiglu_alpha": float(getattr(hc, "swiglu_alpha", 1.702))}


def check_builtin(hc) -> None:
    """What a gpt-oss checkpoint may hold that the built-in model does not compute: a
    quantization other than MXFP4 (which the load dequantizes, ``usp.models.mxfp4``), each
    refused naming the key."""
    quant = getattr(hc, "quantization_config", None) or {}
    method = quant.get("quant_method") if isinstance(quant, dict) else \
        getattr(quant, "quant_method", None)
    if quant and str(method) not in ("mxfp4", "QuantizationMethod.MXFP4"):
        raise ValueError(f"quantization_config.quant_method={method!r}: usp reads gpt-oss "
                         "weights unquantized or in MXFP4 only; dequantize the checkpoint")


def write(mc) -> dict:
    """The ``GptOssConfig`` keywords of ``mc``: the biases, each layer's type, the experts
    (``intermediate_size`` is an expert's width), no auxiliary loss. Without a window the
    config keeps its class's ``sliding_window``, which no layer then uses (transformers builds
    the sliding mask whatever ``layer_types`` say, and needs one)."""
    windows = write_layer_windows(mc)
    del windows["use_sliding_window"]  # GptOssConfig has none: layer_types say it
    if mc.sliding_window is None:
        del windows["sliding_window"]
    return dict(**windows, attention_bias=mc.qkv_bias, num_local_experts=mc.n_experts,
                num_experts_per_tok=mc.experts_per_token, intermediate_size=mc.expert_ffn_dim,
                swiglu_limit=mc.swiglu_limit, swiglu_alpha=mc.swiglu_alpha,
                output_router_logits=bool(mc.router_aux_loss_coef),
                router_aux_loss_coef=mc.router_aux_loss_coef or 0.0)


def check_hf(mc) -> None:
    """``model.hf=gpt_oss`` starts from a checkpoint and trains without a router loss."""
    from_checkpoint(mc, "gpt_oss", "experts, sinks and router")
    refuse_router_loss(mc)


def check_arch(mc) -> None:
    """A run from a gpt-oss checkpoint has what every ``GptOssForCausalLM`` has: sinks, q/k/v
    biases if and only if an o_proj bias (one ``attention_bias``), gpt-oss's experts (on every
    layer: ``model.sparse_layers`` is not a gpt-oss setting, refused as such)."""
    for key, fine in (("attention_sinks", mc.attention_sinks), ("o_bias", mc.o_bias == mc.qkv_bias),
                      ("n_experts", mc.n_experts is not None and mc.clamped_experts)):
        if not fine:
            raise ValueError(f"model.arch=gpt_oss: model.{key}={getattr(mc, key)} is not a "
                             "gpt-oss (sinks on every layer, q/k/v and o_proj biases together, "
                             "clamped experts with swiglu_limit and swiglu_alpha on every "
                             "layer); set model.*=auto from model.pretrained")
