"""What may reach usp's attention in a patched transformers model (``usp.models.hf``):
the keywords of the attention call, and ``position_ids`` without ``segment_ids``.

A keyword is honoured (``UspAttention``'s signature), on ``NEUTRAL_KEYWORDS`` (known not to
change attention's result), accepted only while unset (``UNSET_KEYWORDS``: None or False),
or refused by name: no keyword is dropped.
"""

from __future__ import annotations

import torch

from ..layout import SequenceLayout

# keywords that reach attention without changing its result, with why
NEUTRAL_KEYWORDS = {
    "position_ids": "RoPE rotated q and k by them before the call",
    "cache_position": "where a KV cache writes; attention takes the k/v it is given",
    "use_cache": "whether the model keeps a KV cache (refused with SP by the pre-hook)",
    "output_router_logits": "a mixture-of-experts output, computed beside attention",
    "output_hidden_states": "which layer outputs the model returns",
    "return_dict": "the form of the model's output",
    "num_items_in_batch": "the loss' normaliser",
}
TOKEN_SINKS = ("sinks computed per token (a [B, H, L, 1] logit); usp attention takes one "
               "logit per query head, passed as s_aux= (gpt-oss's sinks); use an unpatched "
               "model")
VARLEN = ("flash-attention's packed-sequence boundaries; usp takes document boundaries as "
          "segment_ids (usp.models.hf.shard_batch(layout, ..., position_ids=...))")
# keywords usp honours only while unset (None or False): what each would ask for
UNSET_KEYWORDS = {
    "sinks": TOKEN_SINKS,
    "output_attentions": "the attention weights, which usp attention never forms",
    "past_key_values": "a KV cache, which usp attention does not keep",
    "past_key_value": "a KV cache, which usp attention does not keep",
    "cu_seq_lens_q": VARLEN, "cu_seq_lens_k": VARLEN,
    "max_length_q": VARLEN, "max_length_k": VARLEN,
}


def check_keywords(module, kwargs: dict) -> None:
    """Refuse a keyword of the attention call that usp neither honours nor knows to be
    neutral (``NEUTRAL_KEYWORDS``), or one of ``UNSET_KEYWORDS`` that is set."""
    for key, value in kwargs.items():
        if key in NEUTRAL_KEYWORDS:
            continue
        who = type(module).__name__
        if key in UNSET_KEYWORDS:
            if value is None or value is False:
                continue
            raise ValueError(f"{who} passes {key}= to attention: {UNSET_KEYWORDS[key]}")
        raise ValueError(f"{who} passes {key}= to attention, a keyword usp does not know to "
                         "leave attention's result unchanged, so usp refuses it rather than "
                         "drop it; use an unpatched model (or ask usp to support it)")


def check_positions(pos: torch.Tensor, layout: SequenceLayout) -> None:
    """Without ``segment_ids`` every token sees its whole row, so ``position_ids`` [B, L/P]
    must not restart: transformers reads a restart as the start of a packed document and
    would mask there. At P = 1 a row may start anywhere; with SP (where this rank sees only
    its shard) they must be the tokens' global index, 0 .. L-1."""
    offset = pos - layout.positions(pos.device)  # [B, L/P]: position minus global index
    ok = bool((offset == offset[:, :1]).all()) if layout.mesh.sp_size == 1 else not offset.any()
    if not ok:
        raise ValueError("position_ids restart or jump inside a row (packed documents?) but no "
                         "segment_ids were given, so usp attention would let every token see "
                         "the whole row; build the batch with usp.models.hf.shard_batch(layout, "
                         "..., position_ids=...), which gives segment_ids for the documents"
                         + ("" if layout.mesh.sp_size == 1 else ", or pass the global index "
                            "0 .. L-1 as position_ids"))
