"""The transformers config a Qwen3-MoE (``Qwen3MoeConfig``) reads and writes: Qwen3's q/k
norms, a window on every layer or none (transformers 5.25's Qwen3-MoE has no ``layer_types``:
``use_sliding_window`` windows every layer), and its experts (``num_experts``,
``num_experts_per_tok``,
``moe_intermediate_size``, ``norm_topk_prob``, which layers are sparse); what it refuses."""

from __future__ import annotations

from ..family import common_fields, from_checkpoint, refuse_biases, refuse_router_loss, windows


def sparse_layers(hc) -> list[int] | None:
    """The sparse layers of a ``Qwen3MoeConfig`` ``hc`` as transformers builds them (layer i
    when i is not in ``mlp_only_layers`` and ``(i + 1) % decoder_sparse_step == 0``); None
    when every layer is."""
    step, dense = hc.decoder_sparse_step, set(hc.mlp_only_layers or ())
    layers = [i for i in range(hc.num_hidden_layers)
              if hc.num_experts > 0 and i not in dense and (i + 1) % step == 0]
    return None if len(layers) == hc.num_hidden_layers else layers


def read(hc) -> dict:
    """``ModelConfig`` fields of a ``Qwen3MoeConfig``: q/k norms, its windows, the dense MLP's
    width as ``ffn_dim`` (``intermediate_size``), its experts and the weight of its router loss
    (``usp.models.family.router_aux_loss_coef``); ``attention_bias`` (an o_proj bias too) is
    refused."""
    if getattr(hc, "attention_bias", False):
        raise ValueError("attention_bias=true: usp computes Qwen3-MoE without biases on q, k, "
                         "v and o_proj")
    window = hc.sliding_window if getattr(hc, "use_sliding_window", False) else None
    return {**common_fields(hc), "qk_norm": True, "sliding_window": window,
            "n_experts": hc.num_experts, "experts_per_token": hc.num_experts_per_tok,
            "expert_ffn_dim": hc.moe_intermediate_size,
            "norm_topk_prob": bool(hc.norm_topk_prob), "sparse_layers": sparse_layers(hc)}


def write(mc) -> dict:
    """The ``Qwen3MoeConfig`` keywords of ``mc``: no bias, the window of every layer, the experts,
    every layer not in ``sparse_layers`` dense (``mlp_only_layers``), no auxiliary loss."""
    dense = [] if mc.sparse_layers is None else \
        [i for i in range(mc.n_layers) if i not in mc.sparse_layers]
    return dict(attention_bias=False, use_sliding_window=mc.sliding_window is not None,
                sliding_window=mc.sliding_window, num_experts=mc.n_experts,
                num_experts_per_tok=mc.experts_per_token,
                moe_intermediate_size=mc.expert_ffn_dim, norm_topk_prob=mc.norm_topk_prob,
                decoder_sparse_step=1, mlp_only_layers=dense,
                output_router_logits=bool(mc.router_aux_loss_coef),
                router_aux_loss_coef=mc.router_aux_loss_coef or 0.0)


def check_hf(mc) -> None:
    """``model.hf=qwen3_moe`` starts from a checkpoint and trains without a router loss."""
    from_checkpoint(mc, "qwen3_moe", "experts and router")
    refuse_router_loss(mc)


def check_arch(mc) -> None:
    """A run from a Qwen3-MoE checkpoint has no q/k/v biases, a window on every layer or
    none, and states its experts."""
    refuse_biases(mc, "qwen3_moe")
    if windows(mc) == "some":
        raise ValueError("model.arch=qwen3_moe windows every layer or none (transformers' "
                         "Qwen3MoeConfig has no layer_types); set model.full_attention_every=0 "
                         "and model.layer_types=null, or model.sliding_window=null")
    if mc.n_experts is None:
        raise ValueError("model.arch=qwen3_moe is a mixture of experts: set model.n_experts, "
                         "model.experts_per_token, model.expert_ffn_dim and "
                         "model.norm_topk_prob (auto reads them from model.pretrained)")
