"""A Gemma 3 4B-27B checkpoint holds its text model's tensors under the names a
``Gemma3ForCausalLM`` gives them (``usp.models.gemma3_text.state_dict_adapter``) behind
``language_model.``: ``language_model.model.layers.i...``, ``language_model.model.embed_tokens
.weight`` and, untied, ``language_model.lm_head.weight``. transformers 5.25's
``save_pretrained`` writes them so, as the released checkpoints hold them. It loads the same
tensors from its model's own names too (``model.language_model.layers.i...``,
``lm_head.weight``: its ``llava`` key mapping, which Gemma 3 uses), so a checkpoint may hold
either (``STORED_AS``). The vision tower's and projector's tensors (``vision_tower.``,
``multi_modal_projector.``) load into nothing."""

from __future__ import annotations

from ..gemma3_text.state_dict_adapter import names as text_names

# a Gemma3ForCausalLM name's prefix -> the prefix of the same tensor in a gemma3 checkpoint
PREFIXES = (("model.", "language_model.model."), ("lm_head.", "language_model.lm_head."))
# those prefixes -> the other one transformers 5.25 loads the same tensor from
STORED_AS = (("language_model.model.", "model.language_model."),
             ("language_model.lm_head.", "lm_head."))


def names(mc) -> dict[str, str]:
    """Every parameter of the built-in Gemma 3 of ``mc`` -> its name in a gemma3 checkpoint."""
    out = {}
    for usp, hf in text_names(mc).items():
        mine, theirs = next(p for p in PREFIXES if hf.startswith(p[0]))
        out[usp] = theirs + hf[len(mine):]
    return out
