"""Scoring on data no training step draws: the validation loss of the validation splits
during the run, and the held-out answer accuracy at its end."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ..data.dataset import TrainingData
from ..data.packing import IGNORE_INDEX
from ..mesh import SPMesh
from ..run import RunLayout
from .forward import loss_and_predictions


@torch.no_grad()
def evaluate(model, data: TrainingData, batch_per_dp_rank: int, mesh: SPMesh, positions,
             device) -> float:
    """Answer accuracy on ``data.eval_batches`` batches no training step has drawn (held out)."""
    model.eval()
    hits = torch.zeros(2, dtype=torch.float64, device=device)
    for i in range(data.eval_batches):
        b = data.model_batch(10**6 + i, batch_per_dp_rank, mesh.dp_rank, mesh.dp,
                             positions=positions).to(device)
        _, predictions = loss_and_predictions(model, b, positions)
        correct, answers = data.answer_accuracy(predictions, b.labels)
        hits += torch.tensor([correct, answers], dtype=torch.float64, device=device)
    dist.all_reduce(hits, group=mesh.group("dp_sp"))
    model.train()
    return (hits[0] / hits[1].clamp(min=1)).item()


@torch.no_grad()
def validation_loss(model, val: TrainingData, windows: int, batch_per_dp_rank: int,
                    mesh: SPMesh, positions, device) -> float:
    """Mean cross-entropy per target token on the first ``windows`` windows of the
    validation split, whatever the dp split: dp rank r scores windows ``first + r*b ...``
    of each round; a rank short of windows in the last round scores a window with every
    label ignored (it must still join every collective of the forward)."""
    model.eval()
    b, dp = batch_per_dp_rank, mesh.dp
    sums = torch.zeros(2, dtype=torch.float64, device=device)
    for first in range(0, windows, b * dp):
        ids = torch.arange(first + mesh.dp_rank * b, first + (mesh.dp_rank + 1) * b)
        real = ids < windows
        batch = val.model_windows(torch.where(real, ids, 0).numpy(), positions)
        batch.labels[~real] = IGNORE_INDEX  # [B, L/P]: rows past the last window count for nothing
        batch = batch.to(device)
        loss_sum, _ = loss_and_predictions(model, batch, positions)
        sums += torch.stack([loss_sum.double(),
                             (batch.labels != IGNORE_INDEX).sum().to(torch.float64)])
    dist.all_reduce(sums, group=mesh.group("dp_sp"))
    model.train()
    return (sums[0] / sums[1].clamp(min=1)).item()


def _validate(model, val, run: RunLayout, mesh: SPMesh, positions, device) -> dict:
    """``val_loss`` and ``val_ppl`` of the validation splits ``val`` [(name, weight, split)];
    for a blend also each source's (``val_loss/<name>``), and ``val_loss`` is their mean by
    the blend's weights."""
    out, total, weights = {}, 0.0, 0.0
    for name, weight, split in val:
        loss = validation_loss(model, split, split.eval_windows, run.batch_per_dp_rank, mesh,
                               positions, device)
        if len(val) > 1:
            out[f"val_loss/{name}"] = loss
        total, weights = total + weight * loss, weights + weight
    out["val_loss"] = total / weights
    out["val_ppl"] = math.exp(min(out["val_loss"], 700.0))
    return out
