"""Packed documents: what a training batch carries when a row holds several documents.

A packed row of length L is a run of whole or cut documents, each contiguous. Three
per-token facts follow from where the documents start, and every dataset derives them
here:

- ``segment_ids`` [B, L]: the document each token belongs to (attention stays inside it);
- ``doc_positions`` [B, L]: the token's index inside its document, counted from the row
  start for a document the row cuts (RoPE positions that restart at each document);
- labels that would cross a boundary (a document's last token predicting the next
  document's first) are ignored, decided on the global sequence before sharding.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

IGNORE_INDEX = -100


@dataclass(frozen=True)
class Batch:
    """One rank's training batch: long tensors [B, n] (n = L, or the columns a rank holds).

    ``segment_ids`` and ``doc_positions`` are None when documents are not packed
    (``packing="none"``): attention then sees the whole row and RoPE uses the row positions.
    ``weights`` (float32, ``trainer.loss_norm=document``): each labelled token's weight in
    the loss, 1 / the labelled tokens of its document, decided on the global row; None:
    every labelled token weighs 1.
    """

    tokens: torch.Tensor
    labels: torch.Tensor
    segment_ids: torch.Tensor | None = None
    doc_positions: torch.Tensor | None = None
    weights: torch.Tensor | None = None

    def loss_count(self) -> float:
        """This batch's share of the loss normaliser of its step: its labelled tokens, or
        with ``weights`` (``trainer.loss_norm=document``) their sum, the fraction of the
        step's documents it holds (a document's weights sum to 1 over its global row)."""
        if self.weights is None:
            return float((self.labels != IGNORE_INDEX).sum().item())
        return float(self.weights.double().sum().item())

    def to(self, device) -> "Batch":
        move = {k: (v if v is None else v.to(device)) for k, v in vars(self).items()}
        return Batch(**move)

    def columns(self, positions: torch.Tensor | None) -> "Batch":
        """The columns ``positions`` (global ids: [n] for every row, or [B, n] each row its
        own) of full rows [B, L]; all when None."""
        if positions is None:
            return self
        idx = positions.cpu()
        if idx.dim() == 2:  # [B, n]: row b's own columns
            pick = {k: (v if v is None else v.gather(1, idx)) for k, v in vars(self).items()}
        else:
            pick = {k: (v if v is None else v[:, idx]) for k, v in vars(self).items()}
        return replace(self, **pick)  # [B, L] -> [B, n]


def document_positions(segment_ids: torch.Tensor) -> torch.Tensor:
    """[B, L] ids of contiguous documents -> [B, L] index of each token in its document."""
    j = torch.arange(segment_ids.shape[1]).expand_as(segment_ids)  # [B, L] column index
    starts = torch.ones_like(segment_ids, dtype=torch.bool)
    starts[:, 1:] = segment_ids[:, 1:] != segment_ids[:, :-1]  # a document begins here
    first = torch.where(starts, j, torch.zeros_like(j)).cummax(dim=1).values  # its first column
    return j - first


def ignore_crossing(labels: torch.Tensor, segment_ids: torch.Tensor,
                    next_ids: torch.Tensor) -> torch.Tensor:
    """Labels with -100 wherever the target token (document ``next_ids``) lies in another
    document than the predicting token (``segment_ids``); all [B, n]."""
    return labels.masked_fill(segment_ids != next_ids, IGNORE_INDEX)


def packed_rows(tokens: torch.Tensor, labels: torch.Tensor, segment_ids: torch.Tensor) -> Batch:
    """Full rows [B, L] whose documents end inside the row -> their packed ``Batch``."""
    next_ids = torch.cat([segment_ids[:, 1:], segment_ids[:, -1:] + 1], dim=1)  # [B, L]
    return Batch(tokens, ignore_crossing(labels, segment_ids, next_ids), segment_ids,
                 document_positions(segment_ids))
