"""Qwen3 (transformers' ``qwen3``, ``Qwen3ForCausalLM``): the shared decoder with an RMSNorm
of each q and k head before RoPE (``model.qk_norm``, always), no q/k/v bias, its own
``head_dim`` and a window per layer (``layer_types``). A built-in model with ``qk_norm``
exports as a Qwen3 at any windows."""

from ..family import Family
from .config import check_arch, read, write
from .state_dict_adapter import names

FAMILY = Family(name="qwen3", config_class="Qwen3Config", read=read, write=write,
                qk_norm=True, check_arch=check_arch, names=names)
