"""Gemma 3 4B-27B (transformers' ``gemma3``, ``Gemma3ForConditionalGeneration``): a Gemma 3
text model (``usp.models.gemma3_text``: the same blocks, ``Gemma3Text``) beside a SigLIP vision
tower and its projector. usp reads the text model's config (``text_config``) and weights
(``language_model.``), trains it as the built-in Gemma 3 and exports it as ``gemma3_text``
(``Gemma3ForCausalLM``); the vision tower and projector are neither loaded nor computed nor
exported (``Family.text_model``), and ``model.hf=gemma3`` is refused by name."""

from ..family import Family, TextModel
from ..gemma3_text.model import Gemma3Text
from .config import check_arch, check_builtin, read
from .state_dict_adapter import STORED_AS, names

FAMILY = Family(name="gemma3", config_class="Gemma3Config", read=read, write=None,
                qk_norm=True, check_arch=check_arch, check_builtin=check_builtin,
                holds=("local_rope_theta", "query_pre_attn_scalar"), model=Gemma3Text,
                names=names, stored_as=STORED_AS,
                text_model=TextModel(family="gemma3_text", config="text_config",
                                     others="a SigLIP vision tower and its projector"))
