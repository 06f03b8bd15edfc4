"""The transformers config a Qwen3 reads and writes: q/k norms, no bias, windows per layer from
``layer_types`` (transformers derives it from ``use_sliding_window`` /
``max_window_layers``); what it refuses."""

from __future__ import annotations

from ..family import common_fields, read_layer_windows, refuse_biases, write_layer_windows


def read(hc) -> dict:
    """``ModelConfig`` fields of a ``Qwen3Config``: the q/k norms and its windows (when some
    layers are full, which ones: ``layer_types``); ``attention_bias`` is refused (it adds an
    o_proj bias too, which the built-in model has not)."""
    if getattr(hc, "attention_bias", False):
        raise ValueError("attention_bias=true: the built-in model has no o_proj bias (Qwen3's "
                         "attention_bias puts one on q, k, v and o_proj); train it with "
                         "model.hf=qwen3")
    return {**common_fields(hc), "qk_norm": True, **read_layer_windows(hc)}


def write(mc) -> dict:
    """The ``Qwen3Config`` keywords of ``mc``: no bias, each layer's window in
    ``layer_types`` (``mc.layer_window``)."""
    return dict(attention_bias=False, **write_layer_windows(mc))


def check_arch(mc) -> None:
    """A run from a Qwen3 checkpoint has no q/k/v biases (its norms: ``families``)."""
    refuse_biases(mc, "qwen3")
