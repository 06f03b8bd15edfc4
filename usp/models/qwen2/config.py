"""The transformers config a Qwen2 reads and writes: q/k/v biases, windows per layer from
``layer_types`` (transformers derives it from ``use_sliding_window`` /
``max_window_layers``)."""

from __future__ import annotations

from ..family import common_fields, read_layer_windows, write_layer_windows


def read(hc) -> dict:
    """``ModelConfig`` fields of a ``Qwen2Config``: biases, and its windows (when some layers
    are full, which ones: ``layer_types``)."""
    return {**common_fields(hc), "qkv_bias": True, **read_layer_windows(hc)}


def write(mc) -> dict:
    """The ``Qwen2Config`` keywords of ``mc``'s windows: each layer marked in ``layer_types``
    (``mc.layer_window``)."""
    return write_layer_windows(mc)
