"""gpt-oss (transformers' ``gpt_oss``, ``GptOssForCausalLM``) on the built-in model
(``model.GptOss``): the shared decoder with q/k/v and o_proj biases, learned attention sinks,
a band on alternate layers (``layer_types``), YaRN, and on every layer gpt-oss's mixture of
experts (``usp.models.moe.GptOssMoeBlock``), its experts replicated on every rank (expert
degree 1). Released checkpoints store the expert weights in MXFP4, dequantized at load
(``usp.models.mxfp4``). Only a run from its checkpoint (``model.arch``) is a gpt-oss;
``model.hf=gpt_oss`` trains transformers' class through usp's attention."""

from ..family import Family
from .config import check_arch, check_builtin, check_hf, read, write
from .model import GptOss
from .state_dict_adapter import names

FAMILY = Family(name="gpt_oss", config_class="GptOssConfig", read=read, write=write,
                biases=True, check_hf=check_hf, check_arch=check_arch,
                check_builtin=check_builtin,
                holds=("n_experts", "experts_per_token", "expert_ffn_dim", "o_bias",
                       "attention_sinks", "swiglu_limit", "swiglu_alpha"),
                model=GptOss, names=names, experts=True)
