"""gpt-oss's weights: the shared decoder's with q/k/v biases, an o_proj bias and the sinks of
each layer's attention, and as each layer's MLP the router and the experts, fused in 3D tensors
with transformers' names (``usp.models.moe.GptOssMoeBlock``: the same names, the same layouts,
on disk as in memory). A released checkpoint stores the experts' two weights in MXFP4
(``*_blocks`` and ``*_scales``), which the load dequantizes (``usp.models.mxfp4``)."""

from __future__ import annotations

from ..family import decoder_names

DENSE_MLP = ("feed_forward.w1.weight", "feed_forward.w2.weight", "feed_forward.w3.weight")
ATTENTION = {"attention.wo.bias": "self_attn.o_proj.bias", "attention.sinks": "self_attn.sinks"}
# the MLP's parameters (under feed_forward.): transformers' names (under mlp.)
MLP = ("router.weight", "router.bias", "experts.gate_up_proj", "experts.gate_up_proj_bias",
       "experts.down_proj", "experts.down_proj_bias")


def names(mc) -> dict[str, str]:
    """Every parameter of the built-in gpt-oss of ``mc`` -> its name in a
    ``GptOssForCausalLM``."""
    out = decoder_names(mc)
    for i in range(mc.n_layers):
        for k in DENSE_MLP:
            del out[f"layers.{i}.{k}"]
        attention = ATTENTION if mc.o_bias else {"attention.sinks": "self_attn.sinks"}
        out.update({f"layers.{i}.{k}": f"model.layers.{i}.{v}" for k, v in attention.items()})
        out.update({f"layers.{i}.feed_forward.{k}": f"model.layers.{i}.mlp.{k}" for k in MLP})
    return out
