"""gpt-oss (transformers' ``gpt_oss``, ``GptOssForCausalLM``), through ``model.hf`` only:
transformers' class computes it from its checkpoint, usp's attention takes its learned sinks
(``s_aux``) on every layout; q/k/v/o biases, a band on alternate layers (``layer_types``),
YaRN, and a mixture of experts the built-in model does not have yet."""

from ..family import Family
from .config import check_hf, read

FAMILY = Family(name="gpt_oss", config_class="GptOssConfig", read=read, write=None,
                biases=True, check_hf=check_hf, model=None, experts=True)
