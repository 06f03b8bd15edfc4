"""The transformers config a Qwen2 reads and writes: q/k/v biases, windows per layer from
``layer_types`` (transformers derives it from ``use_sliding_window`` /
``max_window_layers``)."""

from __future__ import annotations

from ..family import common_fields


def read(hc) -> dict:
    """``ModelConfig`` fields of a ``Qwen2Config``: biases, and its windows (when some layers
    are full, which ones: ``layer_types``)."""
    fields = {**common_fields(hc), "qkv_bias": True}
    window = getattr(hc, "sliding_window", None) if getattr(hc, "use_sliding_window", True) \
        else None
    types = list(getattr(hc, "layer_types", None) or ["full_attention"] * hc.num_hidden_layers)
    if window is None or "sliding_attention" not in types:
        return fields  # every layer full
    fields["sliding_window"] = window
    if "full_attention" in types:  # some layers windowed: say which
        fields["layer_types"] = types
    return fields


def write(mc) -> dict:
    """The ``Qwen2Config`` keywords of ``mc``'s windows: each layer marked in ``layer_types``
    (``mc.layer_window``)."""
    return dict(use_sliding_window=mc.sliding_window is not None,
                sliding_window=mc.sliding_window,
                layer_types=["full_attention" if mc.layer_window(i) is None
                             else "sliding_attention" for i in range(mc.n_layers)])
