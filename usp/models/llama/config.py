"""The transformers config a Llama reads and writes: the shared fields only; what it refuses."""

from __future__ import annotations

from ..family import common_fields, refuse_biases, windows


def read(hc) -> dict:
    """``ModelConfig`` fields of a ``LlamaConfig``; ``attention_bias`` (an o_proj bias too) and
    ``mlp_bias`` are refused, the built-in model has neither."""
    for key in ("attention_bias", "mlp_bias"):
        if getattr(hc, key, False):
            raise ValueError(f"{key}=true: the built-in model has no such bias (Llama's "
                             "attention_bias adds an o_proj bias too)")
    return common_fields(hc)


def write(mc) -> dict:
    """No ``LlamaConfig`` keyword beyond the shared ones: a Llama has no window."""
    return {}


def check_hf(mc) -> None:
    """A ``LlamaForCausalLM`` has no sliding window."""
    if mc.sliding_window is not None:
        raise ValueError(f"model.hf=llama has no sliding window (model.sliding_window="
                         f"{mc.sliding_window}); set model.sliding_window=null or use "
                         "model.hf=mistral (every layer) or qwen2 (any layers)")


def check_arch(mc) -> None:
    """A run from a Llama checkpoint windows no layer and has no q/k/v biases."""
    refuse_biases(mc, "llama")
    if windows(mc) != "none":
        raise ValueError(f"model.arch=llama has no sliding window (model.sliding_window="
                         f"{mc.sliding_window}); set model.sliding_window=null, or start "
                         "from a Mistral or Qwen2 checkpoint for windows")
