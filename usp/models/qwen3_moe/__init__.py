"""Qwen3-MoE (transformers' ``qwen3_moe``, ``Qwen3MoeForCausalLM``), through ``model.hf``
only: transformers' class computes it from its checkpoint through usp's attention; q/k norms
as Qwen3's, and a mixture of experts the built-in model does not have yet."""

from ..family import Family
from .config import check_hf, read

FAMILY = Family(name="qwen3_moe", config_class="Qwen3MoeConfig", read=read, write=None,
                qk_norm=True, check_hf=check_hf, model=None, experts=True)
