"""Llama (transformers' ``llama``, ``LlamaForCausalLM``): the shared decoder as it is, no
window on any layer, no bias. A built-in model without windows exports as a Llama."""

from ..family import Family
from .config import check_arch, check_hf, read, write

FAMILY = Family(name="llama", config_class="LlamaConfig", read=read, write=write,
                exports="none", check_hf=check_hf, check_arch=check_arch)
