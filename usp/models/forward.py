"""The model on one batch: logits, or (loss sum, predictions), for the built-in model (its
family's class, ``usp.models.families``) and a transformers model alike. The training step, validation and
evaluation all call the model through here."""

from __future__ import annotations

import sys

import torch

from ..data.packing import Batch
from ..models.families import is_builtin
from ..models.tiling import lm_loss, token_losses


def _is_hf(model) -> bool:
    """A transformers model (FSDP keeps the class as a base); transformers is imported
    only when one was built."""
    hf = sys.modules.get("transformers")
    return hf is not None and isinstance(model, hf.PreTrainedModel)


def _rope(batch: Batch, positions: torch.Tensor) -> torch.Tensor:
    """The RoPE positions: the row's global ``positions`` [L/P], or each token's place in
    its document when the batch carries ``doc_positions`` [B, L/P]."""
    return positions if batch.doc_positions is None else batch.doc_positions


def forward(model, batch: Batch, positions: torch.Tensor) -> torch.Tensor:
    """logits [B, L/P, V] of this rank's ``batch`` (on the model's device), at the RoPE
    positions of ``_rope``; ``segment_ids`` only when documents are packed. A transformers
    model (``model.hf``) takes them as ``position_ids`` [B, L/P]."""
    rope = _rope(batch, positions)
    if _is_hf(model):
        ids = {} if batch.segment_ids is None else {"segment_ids": batch.segment_ids}
        return model(input_ids=batch.tokens, position_ids=rope.expand(batch.tokens.shape),
                     use_cache=False, **ids).logits
    if batch.segment_ids is None:
        return model(batch.tokens, rope)
    return model(batch.tokens, rope, batch.segment_ids)


def loss_and_predictions(model, batch: Batch, positions: torch.Tensor):
    """(loss_sum, predictions) of this rank's ``batch``: the summed cross-entropy of its
    labelled tokens (0-dim fp32) and each token's argmax [B, L/P] long. The built-in model
    (``usp.models.families.is_builtin``) computes both itself (so ``model.loss_chunk`` can keep whole logits from
    existing); any other model's logits (``forward``) go through the same loss
    (``usp.models.tiling.lm_loss``). A batch with ``weights`` (``trainer.loss_norm=document``)
    sums each token's loss times its weight; without them (token) the call is unchanged."""
    if not is_builtin(model):
        return lm_loss(forward(model, batch, positions), batch.labels, batch.weights)
    if batch.weights is None:
        return model(batch.tokens, _rope(batch, positions), batch.segment_ids,
                     labels=batch.labels)
    return model(batch.tokens, _rope(batch, positions), batch.segment_ids, labels=batch.labels,
                 weights=batch.weights)


def token_losses_and_predictions(model, batch: Batch, positions: torch.Tensor):
    """(losses [B, L/P] fp32, predictions [B, L/P] long) of this rank's ``batch``: each
    token's cross-entropy (0 where unlabelled) and argmax, for scoring (no gradients). The
    built-in model computes them itself (``per_token``, with ``model.loss_chunk``
    too); any other model's logits go through ``usp.models.tiling.token_losses``."""
    if not is_builtin(model):
        return token_losses(forward(model, batch, positions), batch.labels)
    return model(batch.tokens, _rope(batch, positions), batch.segment_ids, labels=batch.labels,
                 per_token=True)
