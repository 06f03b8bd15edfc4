"""What a model family provides, and what the families the built-in model serves share.

A family (``usp/models/<name>/``, listed in ``usp.models.families``) is a transformers
architecture the built-in model computes exactly: its blocks (``model``: the shared decoder,
``usp.models.decoder.Transformer``, or the family's own), the transformers config it reads
from a checkpoint and writes for ``model.hf`` and the export, what it refuses, and its
state-dict adapter both ways (built-in parameter <-> transformers name; the load inverts the
export's map).

Shared here: the fields every such transformers config holds alike (``common_fields``), the
windows of those that window layer by layer (``read_layer_windows``, ``write_layer_windows``:
Qwen2, Qwen3) and the names of the shared decoder's weights in transformers' Llama layout
(``decoder_names``), which every family uses (Qwen3 adds its q/k norms, Gemma 3 those and
its post norms). Both sides rotate with "rotate half" RoPE
(``usp.models.rope.apply_rope`` is transformers' ``rotate_half``), so every tensor moves over
unchanged, q and k included (no permutation, unlike Meta's original checkpoints).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..config import ModelConfig
from ..config.model import LAYER_TYPES, MOE_FIELDS
from ..config.rope import check_rope_scaling
from .decoder import Transformer

# shared decoder parameter (inside a block) -> transformers name (inside model.layers.i)
BLOCK_NAMES = {"attention.wq.weight": "self_attn.q_proj.weight",
               "attention.wk.weight": "self_attn.k_proj.weight",
               "attention.wv.weight": "self_attn.v_proj.weight",
               "attention.wo.weight": "self_attn.o_proj.weight",
               "feed_forward.w1.weight": "mlp.gate_proj.weight",  # gate
               "feed_forward.w3.weight": "mlp.up_proj.weight",  # up
               "feed_forward.w2.weight": "mlp.down_proj.weight",  # down
               "attention_norm.weight": "input_layernorm.weight",
               "ffn_norm.weight": "post_attention_layernorm.weight"}
QKV_BIASES = {"attention.wq.bias": "self_attn.q_proj.bias",  # with qkv_bias
              "attention.wk.bias": "self_attn.k_proj.bias",
              "attention.wv.bias": "self_attn.v_proj.bias"}
QK_NORMS = {"attention.q_norm.weight": "self_attn.q_norm.weight",  # with qk_norm
            "attention.k_norm.weight": "self_attn.k_norm.weight"}
# how the windows of a built-in model's layers fall: on none, on every layer, on some
WINDOWS = ("none", "every", "some")


def windows(mc: ModelConfig) -> str:
    """Which of ``WINDOWS`` the layers of ``mc`` have (``mc.layer_window``)."""
    windowed = [mc.layer_window(i) is not None for i in range(mc.n_layers)]
    return "none" if not any(windowed) else "every" if all(windowed) else "some"


def common_fields(hc) -> dict:
    """The ``ModelConfig`` fields every family the built-in model computes reads alike from a
    transformers config ``hc`` (``shape_fields``); an MLP other than SwiGLU is refused."""
    act = getattr(hc, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act={act!r}: the built-in model's MLP is SwiGLU (silu)")
    return shape_fields(hc)


def type_rope(hc, layer_type: str = "full_attention") -> dict:
    """The ``rope_parameters`` of a transformers config ``hc``'s layers of ``layer_type``
    (a copy): the dict of that type when RoPE is given per layer type (Gemma 3's, keyed
    ``full_attention`` / ``sliding_attention``), else the one dict of every layer."""
    rope = dict(getattr(hc, "rope_parameters", None) or {})
    if isinstance(rope.get(layer_type), dict):
        return dict(rope[layer_type])
    return {k: v for k, v in rope.items() if not isinstance(v, dict)}


def local_rope_theta(hc) -> float | None:
    """The RoPE base of a transformers config ``hc``'s sliding layers when it gives RoPE per
    layer type (``model.local_rope_theta``), else None (every layer alike)."""
    sliding = (getattr(hc, "rope_parameters", None) or {}).get("sliding_attention")
    theta = sliding.get("rope_theta") if isinstance(sliding, dict) else None
    return None if theta is None else float(theta)


def shape_fields(hc) -> dict:
    """The ``ModelConfig`` fields of a transformers config ``hc``: the shape and RoPE, no
    biases, no windows, no attention scale of its own (a family sets its own). RoPE given
    per layer type is read as its full-attention layers' (``type_rope``: the base and
    scaling that set the context), no experts."""
    heads = hc.num_attention_heads
    rope = type_rope(hc)
    theta = rope.pop("rope_theta", None) or getattr(hc, "rope_theta", 10000.0)
    return dict(vocab_size=hc.vocab_size, dim=hc.hidden_size, n_layers=hc.num_hidden_layers,
                n_heads=heads, n_kv_heads=getattr(hc, "num_key_value_heads", None) or heads,
                ffn_dim=hc.intermediate_size,
                head_dim=getattr(hc, "head_dim", None) or hc.hidden_size // heads,
                rope_theta=float(theta), rope_scaling=check_rope_scaling(rope),
                norm_eps=float(hc.rms_norm_eps), tie_embeddings=bool(hc.tie_word_embeddings),
                qkv_bias=False, qk_norm=False, o_bias=False, attention_sinks=False,
                sliding_window=None, full_attention_every=0,
                layer_types=None, local_rope_theta=None, query_pre_attn_scalar=None,
                router_aux_loss_coef=router_aux_loss_coef(hc), **dict.fromkeys(MOE_FIELDS))


def router_aux_loss_coef(hc) -> float | None:
    """The router's load-balancing loss weight transformers trains a mixture of experts ``hc``
    with: its ``router_aux_loss_coef`` when ``output_router_logits`` is true (only then does
    transformers add it), else 0; None for a dense config."""
    if getattr(hc, "num_local_experts", None) is None and getattr(hc, "num_experts", None) is None:
        return None
    if not getattr(hc, "output_router_logits", False):
        return 0.0
    return float(getattr(hc, "router_aux_loss_coef", 0.0))


def read_layer_windows(hc) -> dict:
    """The windows of a transformers config ``hc`` that windows layer by layer (Qwen2's and
    Qwen3's ``layer_types``, which transformers derives from ``use_sliding_window`` /
    ``max_window_layers``) as ``ModelConfig`` fields: none when every layer is full, the
    window, and when some layers are full which ones (``layer_types``). A layer type other
    than full or sliding attention is refused, named."""
    window = getattr(hc, "sliding_window", None) if getattr(hc, "use_sliding_window", True) \
        else None
    types = list(getattr(hc, "layer_types", None) or ["full_attention"] * hc.num_hidden_layers)
    unknown = sorted(set(types) - set(LAYER_TYPES))
    if unknown:  # transformers knows more kinds of layer (chunked_attention, ...)
        raise ValueError(f"layer_types has {', '.join(unknown)}: usp computes "
                         f"{' and '.join(LAYER_TYPES)} layers only")
    if window is None or "sliding_attention" not in types:
        return {}  # every layer full
    if "full_attention" not in types:
        return {"sliding_window": window}
    return {"sliding_window": window, "layer_types": types}  # some layers windowed: say which


def write_layer_windows(mc: ModelConfig) -> dict:
    """The keywords of a transformers config that windows layer by layer for ``mc``'s
    windows: each layer marked in ``layer_types`` (``mc.layer_window``)."""
    return dict(use_sliding_window=mc.sliding_window is not None,
                sliding_window=mc.sliding_window,
                layer_types=["full_attention" if mc.layer_window(i) is None
                             else "sliding_attention" for i in range(mc.n_layers)])


def decoder_names(mc: ModelConfig) -> dict[str, str]:
    """Every parameter of the shared decoder (``Transformer.state_dict()`` names) -> the name
    of the same tensor in transformers' Llama layout. With tied embeddings there is no
    ``output.weight``: ``lm_head.weight`` is ``embed_tokens``."""
    names = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight"}
    for i in range(mc.n_layers):
        block = {**BLOCK_NAMES, **QKV_BIASES} if mc.qkv_bias else BLOCK_NAMES
        names.update({f"layers.{i}.{k}": f"model.layers.{i}.{v}" for k, v in block.items()})
    if not mc.tie_embeddings:
        names["output.weight"] = "lm_head.weight"
    return names


def _holds_any(mc: ModelConfig) -> None:
    """No refusal: the family holds every setting of ``mc``."""


def refuse_biases(mc: ModelConfig, name: str) -> None:
    """A ``model.arch`` of family ``name``, which has no q/k/v biases, with ``qkv_bias``."""
    if mc.qkv_bias:
        raise ValueError(f"model.arch={name} has no q/k/v biases (model.qkv_bias=true); set "
                         "model.qkv_bias=false, or start from a Qwen2 checkpoint for biases")


def refuse_router_loss(mc) -> None:
    """A ``model.hf`` run of a mixture of experts with a router load-balancing loss
    (``model.router_aux_loss_coef`` > 0, set or read from a checkpoint whose
    ``output_router_logits`` is true): usp's loss of a ``model.hf`` run is the LM loss alone,
    so it would be dropped; refused (the built-in model forms it)."""
    if mc.router_aux_loss_coef:
        raise ValueError(f"model.router_aux_loss_coef={mc.router_aux_loss_coef}: a model.hf "
                         f"run's loss is usp's LM loss alone and transformers' router loss "
                         "would be dropped; train the built-in model (model.hf=null, which "
                         "forms it) or set model.router_aux_loss_coef=0")


def active_ffn(hc, width: int) -> int:
    """The MLP width a token runs through in a mixture of experts of ``width`` per expert:
    its ``num_experts_per_tok`` experts side by side (what its FLOPs count; ``ffn_dim``)."""
    return width * hc.num_experts_per_tok


def from_checkpoint(mc: ModelConfig, name: str, what: str) -> None:
    """``model.hf`` of a mixture of experts without a checkpoint: transformers' class is
    built from the checkpoint's config.json, whose ``what`` usp does not write for it."""
    if mc.pretrained is None:
        raise ValueError(f"model.hf={name} trains from a checkpoint: transformers' class is "
                         f"built from its config.json ({what}); set model=pretrained "
                         f"model.pretrained=DIR (a {name} directory written by save_pretrained), "
                         "or train the built-in model (model.hf=null)")


def _no_zeros(mc: ModelConfig) -> list[str]:
    return []


def _no_experts(mc: ModelConfig) -> dict:
    return {}


def _computes_any(hc) -> None:
    """No refusal: the built-in model computes whatever the family's config holds."""


@dataclass(frozen=True)
class TextModel:
    """A family whose checkpoints hold a text model beside other parts (Gemma 3 4B-27B: a
    vision tower and its projector): usp reads, trains and exports the text model only; the
    other parts' tensors are neither loaded nor computed nor exported."""

    family: str  # the family of the text model alone: the transformers class the export writes
    config: str  # the key of the checkpoint's config that holds the text model's (text_config)
    others: str  # what else the checkpoint holds, in words (named by the export's note)


@dataclass(frozen=True)
class Family:
    """One family: what ``usp.models.families`` lists, and what build, export, evaluation and
    the checks ask it for."""

    name: str  # transformers' model_type: what model.hf and model.arch say
    config_class: str  # the transformers config class written for it
    read: Callable  # a transformers config -> ModelConfig fields (shape, RoPE, windows)
    # ModelConfig -> this family's own transformers config keywords (windows); None: its
    # config comes from a checkpoint only (a family the built-in model does not compute)
    write: Callable | None
    # the windows (WINDOWS) of a built-in model without model.arch that export as this family
    exports: str | None = None
    # holds q/k/v biases at any windows: a built-in model with qkv_bias exports as it when the
    # family of its windows has none (Llama's attention_bias would add an o_proj bias too)
    biases: bool = False
    # normalises q and k per head (model.qk_norm), always: a built-in model with qk_norm exports
    # as it at any windows, and a run from its checkpoint keeps the norms (the others have none)
    qk_norm: bool = False
    check_hf: Callable = _holds_any  # ModelConfig -> ValueError for a model.hf it cannot build
    check_arch: Callable = _holds_any  # ... for a model.arch (a checkpoint's) it cannot hold
    # a checkpoint's transformers config -> ValueError for what transformers' class computes
    # and the built-in model does not (model=pretrained without model.hf)
    check_builtin: Callable = _computes_any
    # the ModelConfig fields (None or false unless set) only some families hold: a model whose
    # family does not list one refuses it set (usp.models.families.check_model)
    holds: tuple[str, ...] = ()
    # the built-in model class that computes it; None: transformers' class computes it, through
    # usp's attention (model.hf and a checkpoint of it only; the built-in model refuses it)
    model: type | None = Transformer
    names: Callable = decoder_names  # ModelConfig -> {built-in parameter: transformers name}
    # ModelConfig -> the transformers weights the built-in model lacks that are exact at zero
    zero_filled: Callable = _no_zeros
    # a mixture of experts: what the planner prices as a dense MLP is not its memory (the
    # experts' weights; usp.models.families.check_priced)
    experts: bool = False
    # ModelConfig -> {a name of ``names`` (experts fused [E, ...]): for each expert, the
    # checkpoint tensors concatenated along dim 0 into its slice}: a checkpoint that stores
    # each expert apart, as transformers writes them (``usp.models.pretrained.expected_tensors``)
    per_expert: Callable = _no_experts
    # a checkpoint's text model beside other parts (TextModel); None: the checkpoint is the text
    # model. model.hf of such a family is refused: transformers' class is the whole model
    text_model: TextModel | None = None
    # (prefix of a name of ``names``, another prefix transformers loads the same tensor from):
    # a checkpoint may store a tensor under either (``stored_names``)
    stored_as: tuple[tuple[str, str], ...] = ()

    @property
    def builtin(self) -> bool:
        """The built-in model computes this family (``model=pretrained`` without ``model.hf``)."""
        return self.model is not None

    def checkpoint_names(self, mc: ModelConfig) -> dict[str, str]:
        """Every tensor of a checkpoint -> the built-in parameter it loads into (the inverse
        of ``names``, the export's map); a tied model takes ``lm_head.weight`` from the
        embedding, so it maps no ``lm_head``."""
        return {hf: usp for usp, hf in self.names(mc).items()}

    def stored_names(self, mc: ModelConfig, stored=()) -> dict[str, str]:
        """``checkpoint_names`` under the names a checkpoint that holds the tensors ``stored``
        uses: a name it lacks is taken under another prefix (``stored_as``) it has, tensor by
        tensor as transformers renames them; one it has under no prefix keeps its own name
        (reported missing)."""
        out = {}
        for hf, usp in self.checkpoint_names(mc).items():
            others = [other + hf[len(mine):] for mine, other in self.stored_as
                      if hf.startswith(mine)]
            out[next((n for n in others if n in stored and hf not in stored), hf)] = usp
        return out
