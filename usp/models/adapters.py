"""State-dict adapters: a transformers checkpoint (``save_pretrained``) as the built-in model.

One adapter per architecture reads the checkpoint's config into ``ModelConfig`` fields and
says which of its tensors becomes which parameter of ``usp.models.decoder.Transformer``. The
name map is the inverse of the export's (``usp.models.llama_hf.hf_names``): the three
decoders lay their weights out alike and both sides rotate with "rotate half" RoPE
(``usp.models.rope.apply_rope`` is transformers' ``rotate_half``), so every tensor moves
over unchanged, q and k included (no permutation, unlike Meta's original checkpoints).

What differs per architecture:

- ``llama``: no window; ``attention_bias`` (an o_proj bias too) and ``mlp_bias`` are
  refused, the built-in model has neither.
- ``mistral``: ``sliding_window`` (or none) on every layer.
- ``qwen2``: q/k/v biases always; windows per layer from ``layer_types`` (transformers
  derives it from ``use_sliding_window`` / ``max_window_layers``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..config import ModelConfig
from ..config.rope import check_rope_scaling
from .llama_hf import hf_names


def _common(hc) -> dict:
    """The fields every mapped architecture shares, from a transformers config ``hc``."""
    act = getattr(hc, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act={act!r}: the built-in model's MLP is SwiGLU (silu)")
    heads = hc.num_attention_heads
    rope = dict(getattr(hc, "rope_parameters", None) or {})
    theta = rope.pop("rope_theta", None) or getattr(hc, "rope_theta", 10000.0)
    return dict(vocab_size=hc.vocab_size, dim=hc.hidden_size, n_layers=hc.num_hidden_layers,
                n_heads=heads, n_kv_heads=getattr(hc, "num_key_value_heads", None) or heads,
                ffn_dim=hc.intermediate_size,
                head_dim=getattr(hc, "head_dim", None) or hc.hidden_size // heads,
                rope_theta=float(theta), rope_scaling=check_rope_scaling(rope),
                norm_eps=float(hc.rms_norm_eps), tie_embeddings=bool(hc.tie_word_embeddings),
                qkv_bias=False, sliding_window=None, full_attention_every=0, layer_types=None)


def _llama(hc) -> dict:
    for key in ("attention_bias", "mlp_bias"):
        if getattr(hc, key, False):
            raise ValueError(f"{key}=true: the built-in model has no such bias (Llama's "
                             "attention_bias adds an o_proj bias too)")
    return _common(hc)


def _mistral(hc) -> dict:
    return {**_common(hc), "sliding_window": getattr(hc, "sliding_window", None)}


def _qwen2(hc) -> dict:
    fields = {**_common(hc), "qkv_bias": True}
    window = getattr(hc, "sliding_window", None) if getattr(hc, "use_sliding_window", True) \
        else None
    types = list(getattr(hc, "layer_types", None) or ["full_attention"] * hc.num_hidden_layers)
    if window is None or "sliding_attention" not in types:
        return fields  # every layer full
    fields["sliding_window"] = window
    if "full_attention" in types:  # some layers windowed: say which
        fields["layer_types"] = types
    return fields


@dataclass(frozen=True)
class Adapter:
    """How checkpoints of one architecture become the built-in model."""

    arch: str  # transformers' model_type
    fields: Callable  # transformers config -> ModelConfig fields (the shape and RoPE)

    def names(self, mc: ModelConfig) -> dict[str, str]:
        """Every tensor of the checkpoint -> the built-in parameter it loads into; a tied
        model takes ``lm_head.weight`` from the embedding, so it maps no ``lm_head``."""
        return {hf: usp for usp, hf in hf_names(mc).items()}


ADAPTERS = {a.arch: a for a in (Adapter("llama", _llama), Adapter("qwen2", _qwen2),
                                Adapter("mistral", _mistral))}


def adapter(model_type: str | None, where: str = "the checkpoint") -> Adapter:
    """The adapter of ``model_type``; ValueError naming the mapped ones otherwise."""
    if model_type not in ADAPTERS:
        raise ValueError(f"{where} is a {model_type!r} model; usp maps {', '.join(ADAPTERS)} "
                         "checkpoints onto its built-in model, and model.hf trains those three "
                         "transformers classes too: usp-train cannot train it. The library "
                         "path patches any decoder transformers ships, or refuses it by name "
                         "(usp.models.hf.patch, docs/huggingface.md)")
    return ADAPTERS[model_type]
