"""Hugging Face transformers decoders through usp: attention, batches and loss.

``patch(model, mesh, layout)`` registers a usp attention function under a name of its own
in transformers' ``AttentionInterface`` (and a mask function that builds no mask in
``AttentionMaskInterface``) and switches the model to it. Each decoder layer then hands
its q/k/v ([B, H, L/P, d], RoPE already applied from ``position_ids``) to
``usp_attention``, which computes exact attention over the whole sequence held across the
SP group; gpt-oss's attention sinks (``s_aux``, one logit per query head) go to it as
``sinks``, and each rank's gradient of them is its share, summed with the other
parameters' over ``dp_sp``. Usage, on every rank::

    import usp.models.hf
    usp.models.hf.patch(model, mesh, layout)
    batch = usp.models.hf.shard_batch(layout, input_ids=ids, labels=ids)  # ids [B, L], global
    out = model(**{k: v for k, v in batch.items() if k != "shift_labels"})
    loss, n = usp.models.hf.causal_lm_loss(out.logits, batch["shift_labels"], mesh)
    loss.backward()  # then sum the gradients over mesh.group("dp_sp")

Packed documents: ``segment_ids`` [B, L/P] travels as a keyword of the model call;
transformers forwards unknown keywords through the decoder layers into the attention
function, which passes them to ``usp_attention``. No per-forward state is kept.

Sliding windows come from the config: ``sliding_window`` on every layer, or on the layers
``layer_types`` marks ``sliding_attention``; the model's own ``sliding_window`` argument to
attention, when it passes one, must agree. The attention scale is the layer's ``scaling``.
What usp cannot honour is refused with a ValueError before any collective: attention
dropout in training, logit softcapping, attention weights, a KV cache when P > 1, padding
masks (use ``segment_ids``), ``labels`` when P > 1 (the model would shift them on its
shard; use ``causal_lm_loss``), RoPE whose frequencies depend on the longest position in
the batch (``dynamic``, ``longrope``) when P > 1, sinks computed per token, a model that
does not declare ``_supports_flash_attn`` (its code may need a mask tensor), and
``position_ids`` that restart inside a row without ``segment_ids`` (transformers would mask
there as between packed documents).

Keywords (``usp.models.hf_keywords``): a keyword that reaches the attention function is
honoured (``UspAttention``'s signature), or on ``NEUTRAL_KEYWORDS`` (known not to change
attention's result), or accepted only while unset (``UNSET_KEYWORDS``: None or False), or
refused by name. A model passes the same keywords on every rank, so the refusal comes in
the first layer, before its collective.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

try:
    from transformers import AttentionInterface, PreTrainedModel
    from transformers.masking_utils import AttentionMaskInterface
except ImportError as e:  # an optional extra
    raise ImportError("usp.models.hf needs transformers: pip install 'usp[hf]'") from e

from ..attention import usp_attention
from ..data.packing import IGNORE_INDEX, document_positions, packed_rows
from ..layout import SequenceLayout
from ..mesh import SPMesh
from ..dims.heads import check_heads
from .hf_keywords import NEUTRAL_KEYWORDS, UNSET_KEYWORDS, check_keywords, check_positions
from .tiling import loss_share

__all__ = ["NEUTRAL_KEYWORDS", "UNSET_KEYWORDS", "UspAttention", "causal_lm_loss",
           "global_batch", "layer_windows", "patch", "shard_batch", "unpatch"]

_POSITION_RANGE_ROPE = ("dynamic", "longrope")  # frequencies from max(position_ids) + 1
_HOOK = "_usp_hf_hook"  # attribute of a patched model: its forward pre-hook handle


def layer_windows(config) -> tuple[int | None, ...]:
    """The sliding window of every decoder layer from an HF config (None: full attention).

    ``layer_types`` decides per layer (``sliding_attention`` / ``full_attention``); without
    it ``sliding_window`` applies to every layer. Other layer types raise ValueError.
    """
    n = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if types is None:
        return (window,) * n
    other = sorted({t for t in types} - {"sliding_attention", "full_attention"})
    if other:
        raise ValueError(f"layer_types {other} are not attention usp computes (it takes "
                         f"full_attention and sliding_attention); use an unpatched model")
    if "sliding_attention" in types and window is None:
        raise ValueError("layer_types has sliding_attention layers but sliding_window is "
                         "None; set config.sliding_window")
    return tuple(window if t == "sliding_attention" else None for t in types)


@dataclass(frozen=True)
class UspAttention:
    """The attention function ``patch`` registers: HF's signature, usp's computation.

    Called by each attention module with q [B, Hq, L/P, d], k/v [B, Hkv, L/P, d] (and
    gpt-oss's ``s_aux`` [Hq], the sinks); returns (out [B, L/P, Hq, d], None) as
    transformers' attention functions do.
    """

    mesh: SPMesh
    layout: SequenceLayout
    windows: tuple[int | None, ...]  # per layer, from the config
    kernel: str = "torch"
    ring_impl: str = "usp"
    a2a_chunks: int | None = None  # pipeline stages (usp_attention's; None: the mesh's)

    def window(self, module, given: int | None) -> int | None:
        layer = getattr(module, "layer_idx", None)
        if layer is None:
            return given
        mine = self.windows[layer]
        if given is not None and given != mine:
            raise ValueError(f"layer {layer} passes sliding_window={given} but its config "
                             f"says {mine}; make config.sliding_window/layer_types agree")
        return mine

    def __call__(self, module, query, key, value, attention_mask, scaling=None,
                 dropout=0.0, sliding_window=None, softcap=None, segment_ids=None,
                 is_causal=None, s_aux=None, **kwargs):
        if attention_mask is not None:
            raise ValueError("usp attention takes no attention_mask (got a prepared "
                             f"{tuple(attention_mask.shape)} mask); pass segment_ids from "
                             "usp.models.hf.shard_batch for packed documents or padding")
        if dropout:
            raise ValueError(f"attention dropout {dropout} in training: usp attention has "
                             "none; set config.attention_dropout = 0.0")
        if softcap:
            raise ValueError(f"attention logit softcapping ({softcap}) is not in usp "
                             "attention; use an unpatched model")
        check_keywords(module, kwargs)
        causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
        # HF [B, H, L/P, d] -> usp [B, L/P, H, d]
        q, k, v = (x.transpose(1, 2) for x in (query, key, value))
        out = usp_attention(q, k, v, mesh=self.mesh, layout=self.layout, causal=causal,
                            kernel=self.kernel, scale=scaling, ring_impl=self.ring_impl,
                            segment_ids=segment_ids, a2a_chunks=self.a2a_chunks,
                            window=self.window(module, sliding_window), sinks=s_aux)
        return out, None  # [B, L/P, Hq, d]: the layer reshapes it to [B, L/P, Hq*d]


def _no_mask(attention_mask=None, **kwargs):
    """Mask function of usp attention: masks are usp's (causal, window, segment_ids)."""
    if attention_mask is not None and not bool(attention_mask.all()):
        raise ValueError("an attention_mask with zeros (padding) reached a usp-patched "
                         "model; build the batch with usp.models.hf.shard_batch(layout, "
                         "attention_mask=...), which turns it into segment_ids and labels")
    return None


def _check_config(model, mesh: SPMesh, layout: SequenceLayout) -> tuple[int | None, ...]:
    if not isinstance(model, PreTrainedModel):
        raise ValueError(f"usp.models.hf.patch takes a transformers PreTrainedModel, got "
                         f"{type(model).__name__}")
    cfg = model.config
    if getattr(cfg, "is_encoder_decoder", False):
        raise ValueError(f"{type(model).__name__} is an encoder-decoder; usp.models.hf patches "
                         "decoder-only models")
    if layout.mesh is not mesh:
        raise ValueError("layout was built for a different SPMesh than the one passed")
    if getattr(cfg, "attn_logit_softcapping", None):
        raise ValueError(f"attn_logit_softcapping={cfg.attn_logit_softcapping}: usp "
                         "attention has no logit softcapping; use an unpatched model")
    if getattr(cfg, "output_attentions", False):
        raise ValueError("config.output_attentions=True: usp attention never forms the "
                         "attention weights; set it to False")
    rope = (getattr(cfg, "rope_parameters", None) or {}).get("rope_type", "default")
    if mesh.sp_size > 1 and rope in _POSITION_RANGE_ROPE:
        raise ValueError(f"rope_type={rope!r} picks its frequencies from the largest "
                         f"position of the batch, which differs between the "
                         f"{mesh.sp_size} SP ranks; use ulysses=ring=1 or a fixed RoPE")
    if mesh.sp_size > 1 and getattr(cfg, "use_cache", False):
        raise ValueError(f"config.use_cache=True with {mesh.sp_size} SP ranks: a KV cache "
                         "would hold only this rank's tokens; set model.config.use_cache "
                         "= False (usp.models.hf is for training and whole-sequence evaluation)")
    if not getattr(model, "_supports_flash_attn", False):
        raise ValueError(f"{type(model).__name__} does not declare _supports_flash_attn, "
                         "transformers' flag for a model whose attention needs no mask tensor; "
                         "usp attention, like flash attention, takes none, so it cannot patch "
                         "it (a model of your own that computes attention from q, k, v alone "
                         "may set the flag)")
    hq = cfg.num_attention_heads
    check_heads(hq, getattr(cfg, "num_key_value_heads", None) or hq, mesh.ulysses)
    return layer_windows(cfg)


def patch(model, mesh: SPMesh, layout: SequenceLayout, *, kernel: str = "torch",
          ring_impl: str = "usp", a2a_chunks: int | None = None) -> str:
    """Route ``model``'s attention through ``usp_attention`` on ``mesh`` / ``layout``.

    Registers ``UspAttention`` (and a mask function that builds no mask) under a name of
    this model, switches the model to it and adds a forward pre-hook that checks every call
    before any collective: sequence length ``layout.local_len``, ``position_ids`` given
    (global ids, as ``shard_batch`` makes them) when P > 1, and no KV cache, padding mask,
    ``labels`` (P > 1), ``output_attentions`` or attention dropout in training. Patching
    again (another layout) replaces the previous patch. Returns the registered name.
    Raises ValueError for a model or config usp cannot compute exactly.
    """
    windows = _check_config(model, mesh, layout)
    unpatch(model, to=None)
    name = f"usp_{id(model):x}"
    AttentionInterface.register(name, UspAttention(mesh, layout, windows, kernel, ring_impl,
                                                    a2a_chunks))
    AttentionMaskInterface.register(name, _no_mask)
    model.set_attn_implementation(name)
    if model.config._attn_implementation != name:
        raise ValueError(f"{type(model).__name__} does not route attention through "
                         "transformers' AttentionInterface, so usp cannot patch it")
    hook = model.register_forward_pre_hook(_CallCheck(mesh, layout), with_kwargs=True)
    setattr(model, _HOOK, hook)
    return name


def unpatch(model, to: str | None = "sdpa") -> None:
    """Remove ``patch``'s pre-hook and, with ``to``, switch attention to ``to``."""
    hook = getattr(model, _HOOK, None)
    if hook is not None:
        hook.remove()
        delattr(model, _HOOK)
    if to is not None:
        model.set_attn_implementation(to)


@dataclass
class _CallCheck:
    """Forward pre-hook of a patched model: refuses a call usp would get wrong."""

    mesh: SPMesh
    layout: SequenceLayout

    def __call__(self, module, args, kwargs):
        x = kwargs.get("input_ids", args[0] if args else None)
        if x is None:
            x = kwargs.get("inputs_embeds")
        if x is not None and x.shape[1] != self.layout.local_len:
            raise ValueError(f"the patched model expects this rank's {self.layout.local_len} "
                             f"tokens (seq_len {self.layout.seq_len} / {self.mesh.sp_size} "
                             f"SP ranks), got {tuple(x.shape)}; shard with "
                             "usp.models.hf.shard_batch(layout, ...)")
        p = self.mesh.sp_size
        if kwargs.get("past_key_values") is not None:
            raise ValueError("past_key_values given: usp attention keeps no KV cache")
        if p > 1:
            if kwargs.get("position_ids") is None:
                raise ValueError("position_ids missing: with SP the model must rotate each "
                                 "token by its global position; pass the position_ids of "
                                 "usp.models.hf.shard_batch")
            if kwargs.get("use_cache"):
                raise ValueError(f"use_cache=True with {p} SP ranks: pass use_cache=False")
            if kwargs.get("labels") is not None:
                raise ValueError("labels given with SP: the model would shift them on its "
                                 "shard and lose the targets at shard edges; use "
                                 "usp.models.hf.causal_lm_loss(logits, batch['shift_labels'], mesh)")
        if kwargs.get("output_attentions"):
            raise ValueError("output_attentions=True: usp attention never forms the weights")
        mask = kwargs.get("attention_mask")
        if mask is not None:
            _no_mask(mask)
        dropout = getattr(module.config, "attention_dropout", 0.0) or 0.0
        if module.training and dropout > 0:
            raise ValueError(f"config.attention_dropout={dropout} in training: usp "
                             "attention has no dropout; set it to 0.0 or call model.eval()")
        pos = kwargs.get("position_ids")
        if pos is not None and pos.dim() == 2 and kwargs.get("segment_ids") is None:
            check_positions(pos, self.layout)
        return None


def global_batch(input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None,
                 position_ids: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """The whole batch, before sharding: long tensors [B, L].

    ``labels`` follow HF (unshifted: ``labels[t]`` is the token at t, -100 to ignore).
    ``attention_mask``: 1 for tokens, 0 for padding, or document numbers 1, 2, ... for
    packed rows. Documents start where ``position_ids`` do not continue (p[t] != p[t-1]+1)
    or the mask value changes; padding forms its own documents.

    Returns ``input_ids``, ``position_ids`` (given, else each token's place in its document),
    ``shift_labels`` (with labels: ``shift_labels[t] = labels[t+1]``, -100 at the last
    token, where the target lies in another document and at padding) and ``segment_ids``
    (only when some row holds more than one document).
    """
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [B, L], got {tuple(input_ids.shape)}")
    for name, t in (("labels", labels), ("attention_mask", attention_mask),
                    ("position_ids", position_ids)):
        if t is not None and t.shape != input_ids.shape:
            raise ValueError(f"{name} {tuple(t.shape)} must match input_ids "
                             f"{tuple(input_ids.shape)}")
    starts = torch.zeros(input_ids.shape, dtype=torch.bool)
    starts[:, 0] = True
    if position_ids is not None:
        position_ids = position_ids.long().cpu()
        starts[:, 1:] |= position_ids[:, 1:] != position_ids[:, :-1] + 1
    if attention_mask is not None:
        attention_mask = attention_mask.long().cpu()
        if bool((attention_mask < 0).any()):
            raise ValueError("attention_mask values must be 0 (padding) or >= 1 (tokens, or "
                             "document numbers)")
        starts[:, 1:] |= attention_mask[:, 1:] != attention_mask[:, :-1]
    seg = starts.long().cumsum(dim=1)  # [B, L] document of each token
    packed = bool((seg[:, -1] > 1).any())
    if position_ids is None:
        position_ids = document_positions(seg)
    out = {"input_ids": input_ids, "position_ids": position_ids}
    if labels is not None:
        # the target of token t is token t+1 of the GLOBAL row, decided before sharding
        shifted = torch.cat([labels[:, 1:].cpu(), labels.new_full((labels.shape[0], 1),
                                                                  IGNORE_INDEX).cpu()], dim=1)
        if attention_mask is not None:
            shifted = shifted.masked_fill(attention_mask == 0, IGNORE_INDEX)  # padding predicts
        out["shift_labels"] = packed_rows(input_ids, shifted, seg).labels
    if packed:
        out["segment_ids"] = seg
    return {k: v.to(input_ids.device) for k, v in out.items()}


def shard_batch(layout: SequenceLayout, input_ids: torch.Tensor,
                labels: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """This rank's columns of ``global_batch(...)``: each [B, L] -> [B, L/P].

    Every SP rank passes the same global batch. ``position_ids`` stay global (RoPE);
    ``shift_labels`` were shifted on the global rows, so no target is lost at shard edges.
    Pass all keys but ``shift_labels`` to the patched model.
    """
    full = global_batch(input_ids, labels, attention_mask, position_ids)
    return {k: layout.shard(v, dim=1) for k, v in full.items()}  # [B, L] -> [B, L/P]


def causal_lm_loss(logits: torch.Tensor, shift_labels: torch.Tensor,
                   mesh: SPMesh) -> tuple[torch.Tensor, torch.Tensor]:
    """(this rank's loss share, global target count) for logits [B, L/P, V] and
    ``shift_labels`` [B, L/P] (-100: no target).

    The share is this rank's summed cross entropy (fp32) over the number of targets of the
    whole dp x sp group (one all-reduce), so the shares sum to the global mean loss and the
    gradients summed over ``mesh.group("dp_sp")`` equal the one-process gradient
    (``usp.models.tiling.loss_share``, which the trainer uses too). A trainer whose gradient
    reduction averages over the dp x sp ranks (FSDP) multiplies the share by their number
    before ``backward``.
    """
    if logits.shape[:2] != shift_labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and shift_labels "
                         f"{tuple(shift_labels.shape)} disagree on [B, L/P]")
    count = (shift_labels != IGNORE_INDEX).sum().to(torch.float64).reshape(1)
    if mesh.dp * mesh.sp_size > 1:
        # Sync: the target count over dp x sp normalises every rank's share
        dist.all_reduce(count, group=mesh.group("loss"))
    loss_sum = F.cross_entropy(logits.float().flatten(0, 1), shift_labels.flatten(),
                               ignore_index=IGNORE_INDEX, reduction="sum")
    return loss_share(loss_sum, count.clamp(min=1).to(loss_sum.dtype)), count[0]
