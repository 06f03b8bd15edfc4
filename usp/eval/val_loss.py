"""Scoring on data no training step draws: the validation loss of the validation splits
during the run (``usp.train.validator.Validator``), and the held-out answer accuracy at its
end (``held_out_accuracy``)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..data.batches import RowLayouts
from ..data.dataset import TrainingData
from ..data.indexing import held_out_batch, step_indices
from ..data.packing import IGNORE_INDEX
from ..mesh import SPMesh
from ..models.forward import loss_and_predictions


@torch.no_grad()
def held_out_accuracy(model, data: TrainingData, batch_per_dp_rank: int, mesh: SPMesh,
                      layouts: RowLayouts) -> float:
    """Answer accuracy on ``data.eval_batches`` batches no training step has drawn (held out),
    each laid out by ``layouts``."""
    model.eval()
    device = layouts.device
    hits = torch.zeros(2, dtype=torch.float64, device=device)
    for i in range(data.eval_batches):
        rows = layouts.rows(data, step_indices(held_out_batch(i), batch_per_dp_rank,
                                               mesh.dp_rank, mesh.dp))
        layouts.enter(rows)
        _, predictions = loss_and_predictions(model, rows.batch, rows.positions)
        correct, answers = data.answer_accuracy(predictions, rows.batch.labels)
        hits += torch.tensor([correct, answers], dtype=torch.float64, device=device)
    dist.all_reduce(hits, group=mesh.group("loss"))
    model.train()
    return (hits[0] / hits[1].clamp(min=1)).item()


@torch.no_grad()
def validation_loss(model, val: TrainingData, windows: int, batch_per_dp_rank: int,
                    mesh: SPMesh, layouts: RowLayouts) -> float:
    """Mean cross-entropy per target token on the first ``windows`` windows of the
    validation split, whatever the dp split: dp rank r scores windows ``first + r*b ...``
    of each round; a rank short of windows in the last round scores a window with every
    label ignored (it must still join every collective of the forward). Each batch laid
    out by ``layouts``."""
    model.eval()
    b, dp, device = batch_per_dp_rank, mesh.dp, layouts.device
    sums = torch.zeros(2, dtype=torch.float64, device=device)
    for first in range(0, windows, b * dp):
        ids = torch.arange(first + mesh.dp_rank * b, first + (mesh.dp_rank + 1) * b)
        real = ids < windows
        rows = layouts.windows(val, torch.where(real, ids, 0).numpy())
        batch = rows.batch  # [B, L/P]: rows past the last window count for nothing
        batch.labels[~real.to(device)] = IGNORE_INDEX
        layouts.enter(rows)
        loss_sum, _ = loss_and_predictions(model, batch, rows.positions)
        sums += torch.stack([loss_sum.double(),
                             (batch.labels != IGNORE_INDEX).sum().to(torch.float64)])
    dist.all_reduce(sums, group=mesh.group("loss"))
    model.train()
    return (sums[0] / sums[1].clamp(min=1)).item()


def mean_loss(model, splits: list, batch_per_dp_rank: int, mesh: SPMesh,
               layouts: RowLayouts, out: dict | None = None) -> float:
    """The validation loss of ``splits`` [(name, weight, split)]: each split's, their mean by
    weight (a blend's ``val_loss``); with ``out``, each source's there too
    (``val_loss/<name>``) when there are several."""
    total = weights = 0.0
    for name, weight, split in splits:
        loss = validation_loss(model, split, split.eval_windows, batch_per_dp_rank, mesh,
                               layouts)
        if out is not None and len(splits) > 1:
            out[f"val_loss/{name}"] = loss
        total, weights = total + weight * loss, weights + weight
    return total / weights


class LengthLoss:
    """The validation loss at another length than the training steps' on the same mesh:
    ``short_val_loss``, at the first phase's length in a later phase (a gate's
    ``val_loss_within``, and the recovery of short-context quality it shows).
    ``splits`` are the validation splits cut at that length, ``layouts`` its
    ``RowLayouts``; the model's attention goes through them while it scores (``use``), back
    to ``train_layout`` afterwards (``usp.train.build.sharded_model``)."""

    def __init__(self, splits: list, layouts: RowLayouts, use, train_layout,
                 batch_per_dp_rank: int, mesh: SPMesh):
        self.splits, self.layouts, self.use = splits, layouts, use
        self.train_layout, self.batch_per_dp_rank, self.mesh = train_layout, batch_per_dp_rank, mesh

    def loss(self, model) -> float:
        """Collective over dp x sp: the mean cross-entropy of the splits' first windows."""
        self.use(self.layouts.sequence)  # per_document: each batch enters its own
        try:
            return mean_loss(model, self.splits, self.batch_per_dp_rank, self.mesh,
                              self.layouts)
        finally:
            self.use(self.train_layout)  # the training steps' layout again
