"""``configs/model``: the shape of the decoder. The defaults are the ``tiny`` option."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, List, Optional

from .checks import above, at_least, one_of
from .rope import check_rope_scaling

LAYER_TYPES = ("full_attention", "sliding_attention")  # model.layer_types: transformers' names
# how the model computes or trains, not its shape: a model option leaves these at their
# defaults
EXECUTION_FIELDS = ("loss_chunk", "mlp_tiles", "norm_tiles", "router_balance_over")
# execution keys the planner may size (``auto``: ``usp.planner.tiles``, resolved with the layout)
PLANNED_FIELDS = ("loss_chunk", "mlp_tiles", "norm_tiles")
AUTO = "auto"


def _fixed(default: Any) -> Any:
    """A field a checkpoint fixes: with ``model.pretrained``, ``auto`` takes the checkpoint's
    value and a set value must equal it (``usp.models.pretrained.fill_model``)."""
    return field(default=default, metadata={"checkpoint": "fixed"})


def _read(default: Any) -> Any:
    """A field ``auto`` reads from a checkpoint, which a set value may change (RoPE)."""
    return field(default=default, metadata={"checkpoint": "read"})


@dataclass
class ModelConfig:
    """Shape of a Llama-style GQA decoder.

    Which families ``hf`` and ``arch`` may name, and the shapes each family holds (a window on
    a Llama, ...), are the models layer's: ``usp.models.families.check_model``, which the CLI,
    ``usp.run.resolve_run`` and ``usp.models.pretrained.pretrained_config`` call."""

    # _fixed: a checkpoint (model.pretrained) fixes it; _read: auto takes the checkpoint's
    vocab_size: int = _fixed(320)
    dim: int = _fixed(128)
    n_layers: int = _fixed(2)
    n_heads: int = _fixed(8)
    n_kv_heads: int = _fixed(2)
    ffn_dim: int = _fixed(384)
    head_dim: Optional[int] = _fixed(None)  # width of a head; None: dim // n_heads (set then)
    rope_theta: float = _read(10000.0)
    # RoPE frequency scaling for context extension, transformers' names (usp/config/rope.py):
    # e.g. {rope_type: yarn, factor: 4, original_max_position_embeddings: 8192}; null: plain.
    # Typed Any, not a dict, so that model.rope_scaling={...} replaces it whole on the command
    # line (Hydra would merge into a dict node, key by key, and refuse the new keys)
    rope_scaling: Any = _read(None)
    # RoPE base of the sliding-window layers (Gemma 3's sliding_attention rope_theta, plain
    # RoPE); None: as every other layer (rope_theta, rope_scaling, which then set the full
    # layers only)
    local_rope_theta: Optional[float] = _read(None)
    norm_eps: float = _fixed(1e-5)
    tie_embeddings: bool = _fixed(True)
    qkv_bias: bool = _fixed(False)  # biases on the q, k and v projections (Qwen2)
    qk_norm: bool = _fixed(False)  # RMSNorm of each q and k head before RoPE (Qwen3)
    o_bias: bool = _fixed(False)  # a bias on the o projection too (gpt-oss)
    # a learned logit per query head in each softmax that carries no value (gpt-oss's sinks)
    attention_sinks: bool = _fixed(False)
    # attention scores scaled by query_pre_attn_scalar ** -0.5 (Gemma 3); None: head_dim's
    query_pre_attn_scalar: Optional[int] = _fixed(None)
    sliding_window: Optional[int] = _fixed(None)  # tokens a query sees (itself included); None: all
    full_attention_every: int = _fixed(0)  # 0: every layer windowed; k: layers k-1, 2k-1, ... full
    # per layer, transformers' names (full_attention | sliding_attention; Qwen2's layer_types):
    # which layers see sliding_window tokens; None: the pattern above
    layer_types: Optional[List[str]] = _fixed(None)
    # a mixture of experts (Qwen3-MoE's): the experts of each sparse layer, those a token runs,
    # their SwiGLU width, whether a token's top-k weights are renormalised to sum to one;
    # None: a dense model (every MLP of ffn_dim)
    n_experts: Optional[int] = _fixed(None)
    experts_per_token: Optional[int] = _fixed(None)
    expert_ffn_dim: Optional[int] = _fixed(None)
    norm_topk_prob: Optional[bool] = _fixed(None)
    # gpt-oss's experts instead (usp.models.moe.GptOssMoeBlock): top-k of the router's logits
    # (which has a bias) then softmax over the k, experts with biases computing
    # (clamp(up, +-limit) + 1) * g * sigmoid(alpha * g), g = clamp(gate, max=limit); None:
    # Qwen3-MoE's (softmax then top-k, norm_topk_prob; SwiGLU experts without biases)
    swiglu_limit: Optional[float] = _fixed(None)
    swiglu_alpha: Optional[float] = _fixed(None)
    # the layers (0-based) whose MLP is the experts; None (with n_experts): every layer. The
    # others are dense SwiGLU MLPs of ffn_dim
    sparse_layers: Optional[List[int]] = _fixed(None)
    # the weight of the router's load-balancing loss in the trained loss (transformers'
    # load_balancing_loss_func over every sparse layer, usp.models.moe_loss); None (auto): the
    # checkpoint's router_aux_loss_coef when its output_router_logits is true (when
    # transformers adds it), else 0; 0: off. Its statistics are pooled over each sequence's
    # ranks (router_balance_over=sp: the batch one dp rank trains) or every rank (dp: the
    # global batch)
    router_aux_loss_coef: Optional[float] = _read(None)
    router_balance_over: str = "sp"
    rope: str = "global"  # global: positions in the packed row | per_document: from each doc start
    # None: the built-in model (usp.models.decoder) | a family (usp.models.families): its
    # transformers class (llama, qwen2, mistral, qwen3)
    hf: Optional[str] = None
    pretrained: Optional[str] = None  # a local model directory (save_pretrained) to start from
    # the family (usp.models.families) the weights come from and export to; None: export
    # picks it from the windows (usp.models.families.hf_equivalent)
    arch: Optional[str] = _fixed(None)
    # tokens per LM-head + loss chunk (full logits never exist); 0: off; auto: the planner's
    # largest chunk that keeps the logits term under its share (usp.planner.tiles)
    loss_chunk: Any = 0
    # sequence tiles of the MLP, recomputed in backward; 1: off; auto: the planner's fewest
    # tiles that keep the MLP's memory under its share (usp.planner.tiles)
    mlp_tiles: Any = 1
    # sequence tiles of each block's two RMSNorms, each tile recomputed in backward (a norm's
    # backward holds six fp32 values a channel); 1: off; auto: the planner's fewest tiles
    # that keep that work under its share (usp.planner.tiles)
    norm_tiles: Any = 1

    def __post_init__(self) -> None:
        one_of("model.rope", self.rope, ("global", "per_document"))
        one_of("model.router_balance_over", self.router_balance_over, ("sp", "dp"))
        self.rope_scaling = check_rope_scaling(self.rope_scaling)
        if self.hf is not None and self.arch not in (None, self.hf):
            raise ValueError(f"model.arch={self.arch} but model.hf={self.hf}: a transformers "
                             "model is its own architecture; set model.arch=null")
        self._check_layers()
        at_least("model", 0, full_attention_every=self.full_attention_every)
        self._check_planned()
        if self.sliding_window is not None:
            at_least("model", 1, sliding_window=self.sliding_window)
        at_least("model", 1, vocab_size=self.vocab_size, dim=self.dim, n_layers=self.n_layers,
                 n_heads=self.n_heads, n_kv_heads=self.n_kv_heads, ffn_dim=self.ffn_dim)
        self._check_experts()
        optional = {k: getattr(self, k) for k in ("local_rope_theta", "query_pre_attn_scalar")
                    if getattr(self, k) is not None}  # None: as the other layers, head_dim
        above("model", 0, rope_theta=self.rope_theta, norm_eps=self.norm_eps, **optional)
        if self.head_dim is None:
            if self.dim % self.n_heads != 0:
                raise ValueError(f"model dim ({self.dim}) must be divisible by n_heads "
                                 f"({self.n_heads}), or set model.head_dim")
            self.head_dim = self.dim // self.n_heads
        at_least("model", 1, head_dim=self.head_dim)
        if self.n_heads % self.n_kv_heads != 0:
            raise ValueError(
                f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})"
            )

    def _check_planned(self) -> None:
        """``loss_chunk`` (>= 0), ``mlp_tiles`` and ``norm_tiles`` (>= 1): whole numbers or
        ``auto``."""
        for k, lo in zip(PLANNED_FIELDS, (0, 1, 1)):
            v = getattr(self, k)
            if v == AUTO:
                continue
            if isinstance(v, bool) or not isinstance(v, int):
                raise ValueError(f"model.{k}={v!r} is neither a whole number nor auto (the "
                                 f"planner sizes it); set model.{k}={lo} or more, or auto")
            at_least("model", lo, **{k: v})

    @property
    def planned(self) -> tuple[str, ...]:
        """The execution keys left to the planner (``PLANNED_FIELDS`` set to ``auto``)."""
        return tuple(k for k in PLANNED_FIELDS if getattr(self, k) == AUTO)

    def _check_layers(self) -> None:
        if self.layer_types is None:
            return
        self.layer_types = list(self.layer_types)
        if len(self.layer_types) != self.n_layers:
            raise ValueError(f"model.layer_types has {len(self.layer_types)} entries for "
                             f"{self.n_layers} layers; give one per layer")
        for t in self.layer_types:
            one_of("model.layer_types[]", t, LAYER_TYPES)
        if "sliding_attention" in self.layer_types and self.sliding_window is None:
            raise ValueError("model.layer_types has sliding_attention layers but "
                             "model.sliding_window=null; set the window")
        if self.full_attention_every:
            raise ValueError(f"model.layer_types and model.full_attention_every="
                             f"{self.full_attention_every} both say which layers are full; "
                             "set model.full_attention_every=0")

    def _check_experts(self) -> None:
        moe = {k: getattr(self, k) for k in MOE_FIELDS}
        if self.n_experts is None:
            given = [k for k, v in moe.items() if v is not None]
            if given:
                raise ValueError(f"model.{given[0]}={moe[given[0]]} without model.n_experts: "
                                 "set model.n_experts (a mixture of experts) or "
                                 f"model.{given[0]}=null")
            return
        # the router's and experts' kind: Qwen3-MoE's (norm_topk_prob) or gpt-oss's (swiglu_*)
        kind = ("swiglu_limit", "swiglu_alpha") if self.clamped_experts else ("norm_topk_prob",)
        missing = [k for k in MOE_FIELDS[:3] + kind if moe[k] is None]
        if missing:
            raise ValueError(f"model.n_experts={self.n_experts} needs "
                             f"{', '.join('model.' + k for k in missing)} set too")
        if self.clamped_experts and self.norm_topk_prob is not None:
            raise ValueError(f"model.norm_topk_prob={self.norm_topk_prob} with model.swiglu_limit="
                             f"{self.swiglu_limit}: gpt-oss's router takes the top-k logits then "
                             "a softmax over them (nothing to renormalise); set "
                             "model.norm_topk_prob=null, or model.swiglu_limit=null and "
                             "model.swiglu_alpha=null for Qwen3-MoE's experts")
        at_least("model", 1, n_experts=self.n_experts, experts_per_token=self.experts_per_token,
                 expert_ffn_dim=self.expert_ffn_dim)
        if self.experts_per_token > self.n_experts:
            raise ValueError(f"model.experts_per_token={self.experts_per_token} > model."
                             f"n_experts={self.n_experts}: a token runs at most every expert")
        if self.sparse_layers is not None:
            self.sparse_layers = sorted(set(self.sparse_layers))
            if self.sparse_layers and not 0 <= self.sparse_layers[0] <= \
                    self.sparse_layers[-1] < self.n_layers:
                raise ValueError(f"model.sparse_layers={self.sparse_layers}: layers are 0 to "
                                 f"{self.n_layers - 1}")

    @property
    def clamped_experts(self) -> bool:
        """The experts are gpt-oss's (``swiglu_limit`` or ``swiglu_alpha`` set), not
        Qwen3-MoE's."""
        return self.swiglu_limit is not None or self.swiglu_alpha is not None

    def sparse(self, layer: int) -> bool:
        """Layer ``layer``'s MLP is the experts (``n_experts``, ``sparse_layers``)."""
        return self.n_experts is not None and (self.sparse_layers is None
                                               or layer in self.sparse_layers)

    def mlp_params(self, layer: int, active: bool = False) -> int:
        """The MLP weights of layer ``layer``: a dense one's, or a sparse one's router and
        experts (``active``: the ``experts_per_token`` a token runs through, else all)."""
        if not self.sparse(layer):
            return 3 * self.dim * self.ffn_dim
        experts = self.experts_per_token if active else self.n_experts
        weights = self.dim * self.n_experts + 3 * self.dim * self.expert_ffn_dim * experts
        if self.clamped_experts and not active:  # biases: the router's, each expert's
            weights += self.n_experts * (1 + 2 * self.expert_ffn_dim + self.dim)
        return weights

    def layer_window(self, layer: int) -> Optional[int]:
        """The sliding window of layer ``layer`` (0-based), or None for full attention.

        ``full_attention_every=k`` keeps every k-th layer full (layers k-1, 2k-1, ...), e.g.
        k=2 alternates windowed and full layers as Gemma-2 does; 0 windows every layer
        (Mistral). ``layer_types``, when set, decides per layer instead."""
        if self.layer_types is not None:
            windowed = self.layer_types[layer] == "sliding_attention"
            return self.sliding_window if windowed else None
        k = self.full_attention_every
        if self.sliding_window is None or (k and (layer + 1) % k == 0):
            return None
        return self.sliding_window

    def layer_rope(self, layer: int) -> tuple[float, Optional[dict]]:
        """The RoPE base and scaling of layer ``layer`` (0-based): its type's
        (``type_rope``; windowed: sliding)."""
        return self.type_rope(self.layer_window(layer) is not None)

    def type_rope(self, sliding: bool) -> tuple[float, Optional[dict]]:
        """The RoPE base and scaling of the sliding (windowed) or the full layers:
        ``local_rope_theta`` with plain RoPE on the sliding ones when it is set, else
        ``rope_theta`` and ``rope_scaling``."""
        if sliding and self.local_rope_theta is not None:
            return self.local_rope_theta, None
        return self.rope_theta, self.rope_scaling

    def attention_params(self) -> int:
        """The weights of a layer's attention projections (q, k, v, o)."""
        d, hd = self.dim, self.head_dim
        return 2 * d * self.n_heads * hd + 2 * d * self.n_kv_heads * hd

    def layer_matmul_params(self) -> int:
        """Weights one token multiplies through in a dense layer (q, k, v, o, gate, up,
        down; a mixture of experts: ``matmul_params``)."""
        return self.attention_params() + 3 * self.dim * self.ffn_dim

    def matmul_params(self) -> int:
        """Weights one token multiplies through in all layers (a sparse layer's router and
        the experts it runs; the LM head aside)."""
        return sum(self.attention_params() + self.mlp_params(i, active=True)
                   for i in range(self.n_layers))

    def num_params(self) -> int:
        """Parameter count (embeddings counted once when tied; every expert)."""
        per_layer = self.attention_params() + 2 * self.dim  # + the two RMSNorm weights
        if self.qkv_bias:
            per_layer += (self.n_heads + 2 * self.n_kv_heads) * self.head_dim
        if self.qk_norm:  # one weight of head_dim for every q head, one for every k head
            per_layer += 2 * self.head_dim
        per_layer += self.dim * self.o_bias + self.n_heads * self.attention_sinks
        emb = self.vocab_size * self.dim * (1 if self.tie_embeddings else 2)
        mlps = sum(self.mlp_params(i) for i in range(self.n_layers))  # dense or experts
        return self.n_layers * per_layer + mlps + emb + self.dim


# a mixture of experts: the fields only such a model holds (ModelConfig._check_experts)
MOE_FIELDS = ("n_experts", "experts_per_token", "expert_ffn_dim", "norm_topk_prob",
              "sparse_layers", "swiglu_limit", "swiglu_alpha")
# the fields a checkpoint fixes, and those ``auto`` may take from one, in declaration order
CHECKPOINT_SHAPE = tuple(f.name for f in fields(ModelConfig)
                         if f.metadata.get("checkpoint") == "fixed")
CHECKPOINT_FIELDS = tuple(f.name for f in fields(ModelConfig) if "checkpoint" in f.metadata)
