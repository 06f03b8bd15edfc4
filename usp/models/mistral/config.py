"""The transformers config a Mistral reads and writes: one ``sliding_window`` (or none) for
every layer; what it refuses."""

from __future__ import annotations

from ..family import common_fields, refuse_biases, windows


def read(hc) -> dict:
    """``ModelConfig`` fields of a ``MistralConfig``: its window on every layer."""
    return {**common_fields(hc), "sliding_window": getattr(hc, "sliding_window", None)}


def write(mc) -> dict:
    """The ``MistralConfig`` keywords of ``mc``'s window."""
    return dict(sliding_window=mc.sliding_window)


def check_hf(mc) -> None:
    """A ``MistralForCausalLM`` windows every layer or none."""
    if mc.sliding_window is not None and mc.full_attention_every:
        raise ValueError(f"model.hf=mistral windows every layer, but model."
                         f"full_attention_every={mc.full_attention_every} asks for full "
                         "layers; set model.full_attention_every=0 or use model.hf=qwen2")


def check_arch(mc) -> None:
    """A run from a Mistral checkpoint windows every layer or none and has no q/k/v biases."""
    refuse_biases(mc, "mistral")
    if windows(mc) == "some":
        raise ValueError("model.arch=mistral windows every layer or none, but model."
                         "full_attention_every / layer_types leave some layers full; window "
                         "every layer, or start from a Qwen2 checkpoint for per-layer windows")
