"""Gemma 3's text model (transformers' ``gemma3_text``, ``Gemma3ForCausalLM``: the 1B), through
``model.hf`` only: transformers' class computes it from its checkpoint through usp's
attention; local layers windowed and global ones full (``layer_types``), q/k norms, a RoPE base
per layer type, its own attention scale (``query_pre_attn_scalar``)."""

from ..family import Family
from .config import check_hf, read

FAMILY = Family(name="gemma3_text", config_class="Gemma3TextConfig", read=read, write=None,
                qk_norm=True, check_hf=check_hf, model=None)
