"""Qwen3-MoE's weights: Qwen3's (the shared decoder's and the q/k norms), with each sparse
layer's MLP the router and the experts fused in 3D tensors, as transformers 5.x holds them
in memory (``usp.models.moe.Qwen3MoeBlock.HF_RENAMES``). On disk (``save_pretrained``,
released checkpoints) each expert's projections are tensors of their own
(``experts.j.gate_proj.weight``, ...): ``per_expert`` says which make each fused one."""

from __future__ import annotations

from ..moe import Qwen3MoeBlock
from ..qwen3.state_dict_adapter import names as qwen3_names

DENSE_MLP = ("feed_forward.w1.weight", "feed_forward.w2.weight", "feed_forward.w3.weight")
# a sparse layer's MLP (under feed_forward.) -> transformers' (under mlp.)
SPARSE_MLP = {k: Qwen3MoeBlock.HF_RENAMES.get(k, k)
              for k in ("router.weight", "experts.gate_up_proj", "experts.down_proj")}
# a fused expert tensor -> the projections of expert j concatenated along dim 0 into its slice
PER_EXPERT = {"experts.gate_up_proj": ("gate_proj.weight", "up_proj.weight"),
              "experts.down_proj": ("down_proj.weight",)}


def names(mc) -> dict[str, str]:
    """Every parameter of the built-in Qwen3-MoE of ``mc`` -> its name in a
    ``Qwen3MoeForCausalLM`` (in memory: the experts fused)."""
    out = qwen3_names(mc)
    for i in range(mc.n_layers):
        if mc.sparse(i):
            for k in DENSE_MLP:
                del out[f"layers.{i}.{k}"]
            out.update({f"layers.{i}.feed_forward.{k}": f"model.layers.{i}.mlp.{v}"
                        for k, v in SPARSE_MLP.items()})
    return out


def per_expert(mc) -> dict[str, list[tuple[str, ...]]]:
    """Each fused expert tensor of ``names`` -> for each expert j, the checkpoint's tensors
    (gate then up; down) that make its slice [j], concatenated along dim 0."""
    out = {}
    for i in range(mc.n_layers):
        if mc.sparse(i):
            for fused, parts in PER_EXPERT.items():
                base = f"model.layers.{i}.mlp.experts"
                out[f"model.layers.{i}.mlp.{fused}"] = [
                    tuple(f"{base}.{j}.{p}" for p in parts) for j in range(mc.n_experts)]
    return out
