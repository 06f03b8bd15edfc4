"""The transformers config of a Gemma 3 4B-27B checkpoint (``Gemma3Config``): its text model's
(``text_config``, a ``Gemma3TextConfig``) read and refused as ``gemma3_text``'s, with two
differences:

- the embeddings are tied as the outer config says (``tie_word_embeddings`` at the top:
  transformers 5.25 ties ``lm_head`` to the embedding by it, whatever ``text_config`` says);
- what the built-in model does not compute has no other path here (``model.hf=gemma3`` is
  refused: transformers' class is the whole model), so the refusal names none.

The released configs state in ``text_config`` only what differs from ``Gemma3TextConfig``'s
defaults (vocab_size, head_dim, the RoPE bases, query_pre_attn_scalar are left out): usp reads
what transformers reads, defaults included."""

from __future__ import annotations

from ..family import refuse_biases
from ..gemma3_text import config as text

# what the refusal of a text model the built-in Gemma 3 does not compute says to do
FIX = ("usp trains the text model of a gemma3 checkpoint as the built-in model only (a "
       "Gemma3ForCausalLM checkpoint of it trains with model.hf=gemma3_text)")


def read(hc) -> dict:
    """``ModelConfig`` fields of a ``Gemma3Config``: its text model's, tied as it says."""
    return {**text.read(hc.text_config), "tie_embeddings": bool(hc.tie_word_embeddings)}


def check_builtin(hc) -> None:
    """What the text model may hold that the built-in Gemma 3 does not compute, refused."""
    text.check_builtin(hc.text_config, FIX)


def check_arch(mc) -> None:
    """A run from a Gemma 3 checkpoint has no q/k/v biases (its norms: ``families``)."""
    refuse_biases(mc, "gemma3")
