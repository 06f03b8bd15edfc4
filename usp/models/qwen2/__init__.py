"""Qwen2 (transformers' ``qwen2``, ``Qwen2ForCausalLM``): the shared decoder with q/k/v
biases (always: zero when the built-in model has none) and a window per layer
(``layer_types``). A built-in model windowed on some layers, or with q/k/v biases at any windows, exports as a
Qwen2."""

from ..family import Family
from .config import read, write
from .state_dict_adapter import zero_filled

FAMILY = Family(name="qwen2", config_class="Qwen2Config", read=read, write=write,
                exports="some", biases=True, zero_filled=zero_filled)
