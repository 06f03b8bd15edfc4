"""A transformers model for training (``model.hf``): its config from a ``ModelConfig``, the
check of a ``model.pretrained`` directory, and the model built from one or the other."""

from __future__ import annotations

from pathlib import Path

import torch

from ..config import ModelConfig
from ..config.rope import rope_parameters
from .families import FAMILIES, check_whole, family
from .family import local_rope_theta, type_rope

# transformers config key -> the ModelConfig field it comes from (for mismatch messages)
_FIELD = {"vocab_size": "vocab_size", "hidden_size": "dim", "num_hidden_layers": "n_layers",
          "num_attention_heads": "n_heads", "num_key_value_heads": "n_kv_heads",
          "intermediate_size": "ffn_dim", "rms_norm_eps": "norm_eps",
          "tie_word_embeddings": "tie_embeddings", "sliding_window": "sliding_window",
          "layer_types": "full_attention_every",
          "query_pre_attn_scalar": "query_pre_attn_scalar", "num_experts": "n_experts",
          "num_experts_per_tok": "experts_per_token", "moe_intermediate_size": "expert_ffn_dim",
          "norm_topk_prob": "norm_topk_prob"}


def hf_config(mc: ModelConfig, max_positions: int | None = None):
    """The transformers config (the class of the family ``mc.hf``,
    ``usp.models.families``) of ``mc``'s shape: no KV cache, no attention dropout; the
    windows as the family writes them (``Family.write``). ``max_position_embeddings``:
    YaRN's scaled length (transformers derives the factor from it), else ``max_positions``
    (the trained length) when given."""
    import transformers

    fam = family(mc.hf)
    if fam.write is None:
        raise ValueError(f"model.hf={mc.hf}: its transformers config is its checkpoint's "
                         "(model.pretrained); usp writes none from the model options")
    kw = dict(vocab_size=mc.vocab_size, hidden_size=mc.dim, intermediate_size=mc.ffn_dim,
              num_hidden_layers=mc.n_layers, num_attention_heads=mc.n_heads,
              num_key_value_heads=mc.n_kv_heads, head_dim=mc.head_dim, rms_norm_eps=mc.norm_eps,
              tie_word_embeddings=mc.tie_embeddings, use_cache=False, attention_dropout=0.0,
              rope_parameters=rope_parameters(mc.rope_theta, mc.rope_scaling))
    scaling = mc.rope_scaling or {}
    if max_positions is not None:
        kw.update(max_position_embeddings=max_positions)
    if scaling.get("rope_type") == "yarn":  # transformers reads the factor from these too
        kw.update(max_position_embeddings=round(
            scaling["factor"] * scaling["original_max_position_embeddings"]))
    kw.update(fam.write(mc))
    return getattr(transformers, fam.config_class)(**kw)


def check_pretrained(mc: ModelConfig) -> None:
    """Refuse ``mc.pretrained`` (ValueError) unless it is a local model directory of
    architecture ``mc.hf`` and exactly ``mc``'s shape."""
    from .pretrained import hf_checkpoint_config

    path = Path(mc.pretrained)
    have = hf_checkpoint_config(path)
    if have.model_type != mc.hf:
        if have.model_type in FAMILIES:  # a whole model (a text model beside others): no model.hf
            check_whole(FAMILIES[have.model_type], f"model.pretrained={path} is a "
                        f"{have.model_type} checkpoint, with model.hf={mc.hf}")
        raise ValueError(f"model.pretrained={path} is a {have.model_type} model but "
                         f"model.hf={mc.hf}; set model.hf={have.model_type}")
    if family(mc.hf).write is None:  # its config is the checkpoint's: the options read it
        diff = [f"{k}: {v!r} there, {getattr(mc, k)!r} from model.{k}"
                for k, v in family(mc.hf).read(have).items() if getattr(mc, k) != v]
    else:
        diff = _diff(mc, have)
    if diff:
        raise ValueError(f"model.pretrained={path} differs from the model config: "
                         f"{'; '.join(diff)}; set the model options to the directory's shape")


def _diff(mc: ModelConfig, have) -> list[str]:
    """What the transformers config ``have`` holds unlike the one usp writes for ``mc``."""
    want = hf_config(mc)
    diff = [f"{key}: {getattr(have, key, None)} there, {getattr(want, key, None)} from "
            f"model.{field}" for key, field in _FIELD.items()
            if getattr(have, key, None) != getattr(want, key, None)]
    head_dim = getattr(have, "head_dim", None) or have.hidden_size // have.num_attention_heads
    if head_dim != mc.head_dim:
        diff.append(f"head_dim: {head_dim} there, {mc.head_dim} from model.head_dim")
    for key, theta in (("rope_theta", type_rope(have).get("rope_theta")),
                       ("local_rope_theta", local_rope_theta(have))):
        if theta != getattr(mc, key):
            diff.append(f"{key}: {theta} there, {getattr(mc, key)} from model.{key}")
    return diff


def build_model(mc: ModelConfig, seed: int):
    """The transformers causal LM of ``mc`` in fp32, in training mode, without KV cache:
    ``mc.pretrained``'s weights, or a fresh init that depends only on ``seed`` (the global
    RNG is left as it was)."""
    from transformers import AutoModelForCausalLM

    if mc.pretrained is not None:
        check_pretrained(mc)
        model = AutoModelForCausalLM.from_pretrained(mc.pretrained, local_files_only=True,
                                                     dtype=torch.float32)
    else:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(hf_config(mc), dtype=torch.float32)
    model.config.use_cache = False
    return model.train()
