"""Exact memory tiling of the two widest activations: the LM head's logits and the MLP's.

- ``chunked_lm_loss``: LM head + cross-entropy ``chunk`` tokens at a time. Forward keeps
  only the hidden states and the head weight; backward recomputes each chunk's logits and
  accumulates the gradients chunk by chunk, so no ``[tokens, V]`` tensor ever exists.
- ``tiled``: a token-wise function (the MLP) over sequence tiles, each recomputed in
  backward (non-reentrant ``torch.utils.checkpoint``), so only one tile's intermediates
  exist at a time.

Both give the same loss and gradients as the untiled computation: every token's logits
and MLP are computed by the same ops on the same values; only the grouping changes.

``lm_loss`` is the untiled loss of whole logits; ``token_losses`` / ``hidden_token_losses``
give each token's own loss and argmax (evaluation: passkey scoring, loss by position);
``loss_share`` turns a rank's loss sum into
what it back-propagates, for the built-in model and a transformers model alike.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ..data.packing import IGNORE_INDEX


def _upcast(logits: torch.Tensor) -> torch.Tensor:
    """Logits in the dtype the loss takes: at least fp32 (bf16 -> fp32; fp64 stays)."""
    return logits.to(torch.promote_types(logits.dtype, torch.float32))


def _chunk_logits(h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """h [c, D], weight [V, D] -> logits [c, V], the matmul in h's dtype, then upcast."""
    return _upcast(F.linear(h, weight))


def _weighted_ce(logits: torch.Tensor, labels: torch.Tensor,
                 weights: torch.Tensor | None) -> torch.Tensor:
    """Summed cross-entropy of logits [c, V] at labels [c] (-100: not counted), each token's
    times ``weights`` [c] when given (``loss_norm=document``)."""
    if weights is None:
        return F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")
    each = F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="none")
    return (each * weights.to(each.dtype)).sum()


class _ChunkedLMLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, labels, chunk, weights=None):
        flat_h = h.reshape(-1, h.shape[-1])  # [B, n, D] -> [B*n, D]
        flat_y = labels.reshape(-1)  # [B, n] -> [B*n]
        flat_w = None if weights is None else weights.reshape(-1)  # [B*n]
        loss = torch.zeros((), dtype=_upcast(h[:0]).dtype, device=h.device)
        preds = torch.empty_like(flat_y)
        for s in range(0, flat_h.shape[0], chunk):
            logits = _chunk_logits(flat_h[s:s + chunk], weight)  # [c, V] fp32
            loss += _weighted_ce(logits, flat_y[s:s + chunk],
                                 None if flat_w is None else flat_w[s:s + chunk])
            preds[s:s + chunk] = logits.argmax(-1)
            del logits  # freed before the next chunk's are made (at most one chunk lives)
        ctx.save_for_backward(h, weight, labels)
        ctx.weights = weights
        ctx.chunk = chunk
        ctx.mark_non_differentiable(preds)
        return loss, preds.view(labels.shape)

    @staticmethod
    def backward(ctx, grad_loss, _grad_preds):
        h, weight, labels = ctx.saved_tensors
        flat_h = h.reshape(-1, h.shape[-1])  # [B*n, D]
        flat_y = labels.reshape(-1)  # [B*n]
        flat_w = None if ctx.weights is None else ctx.weights.reshape(-1)  # [B*n]
        dh = torch.empty_like(flat_h) if ctx.needs_input_grad[0] else None
        # dW summed over chunks in fp32, rounded to the weight's dtype once at the end
        dw = torch.zeros(weight.shape, dtype=_upcast(weight[:0]).dtype, device=weight.device) \
            if ctx.needs_input_grad[1] else None
        for s in range(0, flat_h.shape[0], ctx.chunk):
            hc, yc = flat_h[s:s + ctx.chunk], flat_y[s:s + ctx.chunk]
            # d(sum CE)/d logits = softmax - onehot(label) on counted rows, 0 on ignored ones
            dlogits = torch.softmax(_chunk_logits(hc, weight), dim=-1)  # [c, V] >= fp32
            keep = yc != IGNORE_INDEX  # [c]
            rows = keep.nonzero().squeeze(1)
            dlogits[rows, yc[rows]] -= 1.0
            scale = keep.unsqueeze(1) * grad_loss  # [c, 1]
            if flat_w is not None:  # loss_norm=document: each token's own weight
                scale = scale * flat_w[s:s + ctx.chunk].unsqueeze(1).to(dlogits.dtype)
            dlogits *= scale
            dlogits = dlogits.to(h.dtype)  # the upcast's backward: back to h's dtype
            if dh is not None:
                dh[s:s + ctx.chunk] = dlogits @ weight  # [c, V] @ [V, D] -> [c, D]
            if dw is not None:
                dw += dlogits.t() @ hc  # [V, c] @ [c, D] -> [V, D]
            del dlogits  # freed before the next chunk's logits are made
        return (None if dh is None else dh.view(h.shape),
                None if dw is None else dw.to(weight.dtype), None, None, None)


def chunked_lm_loss(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                    chunk: int, weights: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """LM head + summed cross-entropy, ``chunk`` tokens at a time.

    h [B, n, D] (after the final norm), weight [V, D] (the LM head, or the tied embedding),
    labels [B, n] long (``-100``: not counted) -> (loss_sum: 0-dim fp32 (fp64 for fp64
    h), the sum of the counted tokens' cross-entropy; predictions [B, n] long, each token's
    argmax, no grad). Logits are computed in h's dtype and upcast to fp32 for the loss, as
    ``F.cross_entropy(F.linear(h, weight).float(), labels, reduction="sum")`` does; the
    gradients of h and weight are that expression's. ``weights`` [B, n] (fp32, no grad):
    each token's cross-entropy is multiplied by its weight before the sum
    (``trainer.loss_norm=document``); None sums them plainly.
    """
    if chunk < 1:
        raise ValueError(f"chunked_lm_loss needs chunk >= 1 tokens, got {chunk}")
    if h.dim() != 3 or labels.shape != h.shape[:2] or weight.shape[-1] != h.shape[-1]:
        raise ValueError(f"expected h [B, n, D], labels [B, n], weight [V, D]; got h "
                         f"{tuple(h.shape)}, labels {tuple(labels.shape)}, weight "
                         f"{tuple(weight.shape)}")
    if weights is not None and weights.shape != labels.shape:
        raise ValueError(f"loss weights {tuple(weights.shape)} must match labels "
                         f"{tuple(labels.shape)}: one per token")
    return _ChunkedLMLoss.apply(h, weight, labels, chunk, weights)


def tiled(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, tiles: int,
          dim: int = 1) -> torch.Tensor:
    """``fn(x)`` for a token-wise ``fn``, computed over ``tiles`` slices of ``x`` along
    ``dim`` (sizes differ by at most one), each recomputed in backward.

    Only one tile's intermediates exist at a time, in forward and in backward. With
    gradients off the tiles run plainly, one after another. Nests inside an outer
    non-reentrant checkpoint.
    """
    if tiles <= 1:
        return fn(x)
    parts = torch.tensor_split(x, min(tiles, x.shape[dim]), dim=dim)
    if torch.is_grad_enabled():
        outs = [checkpoint(fn, p, use_reentrant=False) for p in parts]
    else:
        outs = [fn(p) for p in parts]
    return torch.cat(outs, dim=dim)


def lm_loss(logits: torch.Tensor, labels: torch.Tensor,
            weights: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, n, V] (any float dtype), labels [B, n] -> (loss_sum 0-dim fp32, the summed
    cross-entropy of counted tokens, each times its ``weights`` [B, n] when given;
    predictions [B, n] long): ``chunked_lm_loss``'s result from whole logits, upcast to
    fp32 for the loss."""
    logits = _upcast(logits)  # [B, n, V]: bf16 -> fp32 for the loss
    loss = _weighted_ce(logits.flatten(0, 1), labels.flatten(),
                        None if weights is None else weights.flatten())
    return loss, logits.detach().argmax(-1)


def loss_share(loss_sum: torch.Tensor, count: torch.Tensor | float,
               ranks: int = 1) -> torch.Tensor:
    """What one rank back-propagates for ``loss_sum``, its summed loss over its labelled
    tokens: ``loss_sum * ranks / count``, with ``count`` the labelled tokens of the whole
    step over the ``ranks`` ranks whose gradients are reduced (dp x sp).

    ``ranks=1``: the shares sum over the ranks to the global mean loss, so gradients summed
    over them are the one-process gradient. A reduction that averages over the ranks (FSDP)
    undoes a ``ranks`` scale, so the trainer passes ``ranks`` = their number."""
    return loss_sum * (ranks / count)


@torch.no_grad()
def token_losses(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, n, V] (any float dtype), labels [B, n] -> (losses [B, n] fp32 (fp64 for
    fp64 logits): each token's cross-entropy, 0 where the label is ``-100``; predictions
    [B, n] long, each token's argmax). No gradients: for scoring."""
    logits = _upcast(logits)  # [B, n, V]
    losses = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX,
                             reduction="none").view(labels.shape)  # [B*n] -> [B, n]
    return losses, logits.argmax(-1)


@torch.no_grad()
def hidden_token_losses(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                        chunk: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``token_losses`` of the logits ``F.linear(h, weight)`` (h [B, n, D] after the final
    norm, weight [V, D]), made ``chunk`` tokens at a time when ``chunk > 0`` (never a whole
    [B, n, V] tensor, as ``chunked_lm_loss``), whole when ``chunk == 0``."""
    if chunk <= 0:
        return token_losses(F.linear(h, weight), labels)
    flat_h = h.reshape(-1, h.shape[-1])  # [B, n, D] -> [B*n, D]
    flat_y = labels.reshape(-1)  # [B, n] -> [B*n]
    parts = [token_losses(_chunk_logits(flat_h[s:s + chunk], weight).unsqueeze(0),
                          flat_y[s:s + chunk].unsqueeze(0))
             for s in range(0, flat_h.shape[0], chunk)]  # each ([1, c], [1, c])
    losses = torch.cat([p[0] for p in parts], dim=1).view(labels.shape)
    return losses, torch.cat([p[1] for p in parts], dim=1).view(labels.shape)
