"""Qwen3-MoE (transformers' ``qwen3_moe``, ``Qwen3MoeForCausalLM``): the shared decoder with
Qwen3's q/k norms and, on its sparse layers, a mixture of experts (``model.Qwen3Moe``:
``usp.models.moe.Qwen3MoeBlock``), its experts replicated on every rank (expert degree 1).
Its checkpoints store each expert's projections apart (``state_dict_adapter.per_expert``),
which the load stacks into the fused [E, ...] weights. Only a run from its checkpoint
(``model.arch``) is a Qwen3-MoE; ``model.hf=qwen3_moe`` trains transformers' class."""

from ..family import Family
from .config import check_arch, check_hf, read, write
from .model import Qwen3Moe
from .state_dict_adapter import names, per_expert

FAMILY = Family(name="qwen3_moe", config_class="Qwen3MoeConfig", read=read, write=write,
                qk_norm=True, check_hf=check_hf, check_arch=check_arch,
                holds=("n_experts", "experts_per_token", "expert_ffn_dim", "norm_topk_prob",
                       "sparse_layers"),
                model=Qwen3Moe, names=names, per_expert=per_expert, experts=True)
