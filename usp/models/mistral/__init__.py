"""Mistral (transformers' ``mistral``, ``MistralForCausalLM``): the shared decoder with one
``sliding_window`` on every layer (or none). A built-in model windowed on every layer exports
as a Mistral."""

from ..family import Family
from .config import check_arch, check_hf, read, write

FAMILY = Family(name="mistral", config_class="MistralConfig", read=read, write=write,
                exports="every", check_hf=check_hf, check_arch=check_arch)
