"""Gemma 3's text model (transformers' ``gemma3_text``, ``Gemma3ForCausalLM``: the 1B; the
4B-27B ship as ``gemma3``, text under ``text_config``: ``usp.models.gemma3``): its own blocks
on the shared decoder (``model.Gemma3Text``: norms around each part, GeGLU, scaled embeddings),
q/k norms, local layers windowed and global ones full (``layer_types``), a RoPE base per layer
type (``model.local_rope_theta`` for the local ones), its own attention scale
(``model.query_pre_attn_scalar``). Only a run from its checkpoint (``model.arch``) is a Gemma:
a built-in model without ``model.arch`` exports as a family of the shared decoder."""

from ..family import Family
from .config import check_arch, check_builtin, read, write
from .model import Gemma3Text
from .state_dict_adapter import names

FAMILY = Family(name="gemma3_text", config_class="Gemma3TextConfig", read=read, write=write,
                qk_norm=True, check_arch=check_arch, check_builtin=check_builtin,
                holds=("local_rope_theta", "query_pre_attn_scalar"), model=Gemma3Text,
                names=names)
