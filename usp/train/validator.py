"""Scoring on data no training step draws: the validation loss of the validation splits
during the run (``Validator``: ``should_validate``/``validate``), and the held-out answer
accuracy at its end (``evaluate``)."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ..config import DataConfig, MemmapData
from ..data.dataset import TrainingData, source_names
from ..data.indexing import held_out_batch, step_indices
from ..data.packing import IGNORE_INDEX
from ..mesh import SPMesh
from .batches import RowLayouts
from .forward import loss_and_predictions


@torch.no_grad()
def evaluate(model, data: TrainingData, batch_per_dp_rank: int, mesh: SPMesh,
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


def _mean_loss(model, splits: list, batch_per_dp_rank: int, mesh: SPMesh,
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
            return _mean_loss(model, self.splits, self.batch_per_dp_rank, self.mesh,
                              self.layouts)
        finally:
            self.use(self.train_layout)  # the training steps' layout again


class Validator:
    """``trainer.eval_every``: the validation loss of the validation ``splits``
    [(name, weight, split)] (``usp.data.dataset.build_validation``) and, with ``passkey``
    (``usp.train.passkey.PasskeyScore``, ``eval.during_training``), the passkey grid's
    scores, every ``every`` steps and at the last step (``last`` = ``trainer.steps``); none
    when there are neither splits nor passkey.

    ``should_validate(step)`` for 1-based optimizer step ``step``, or 0: before the first
    step, when ``every`` is set (a pretrained model's own loss); ``validate(model)`` is
    collective over dp x sp. ``short`` (``LengthLoss``): also ``short_val_loss``, the loss
    at the first phase's length, in a later length phase (``last`` is then the phase's
    last step)."""

    def __init__(self, splits: list, every: int, last: int, batch_per_dp_rank: int,
                 mesh: SPMesh, layouts: RowLayouts | None, passkey=None,
                 short: LengthLoss | None = None):
        self.splits, self.every, self.last, self.passkey = splits, every, last, passkey
        self.batch_per_dp_rank, self.mesh, self.layouts = batch_per_dp_rank, mesh, layouts
        self.short = short

    def should_validate(self, step: int) -> bool:
        return bool(self.splits or self.passkey) and (step == self.last
                                      or bool(self.every and step % self.every == 0))

    def validate(self, model, step: int | None = None) -> dict:
        """One plain dict keyed as the metrics are: ``val_loss`` and ``val_ppl``; for a blend
        also each source's (``val_loss/<name>``), and ``val_loss`` is their mean by the
        blend's weights; ``short_val_loss`` with ``short``; with ``passkey``,
        ``passkey_acc/<L>`` and ``passkey_logprob/<L>`` per length (the same on every
        rank). A gate on the run's progress reads it here."""
        out = {}
        if self.splits:
            out["val_loss"] = _mean_loss(model, self.splits, self.batch_per_dp_rank, self.mesh,
                                         self.layouts, out)
            out["val_ppl"] = math.exp(min(out["val_loss"], 700.0))
        if self.short is not None:
            out["short_val_loss"] = self.short.loss(model)
        if self.passkey is not None:
            out.update(self.passkey.score(model, step))  # step: passkey.png's title
        return out


def missing_splits(dc: DataConfig, splits: list) -> str | None:
    """The note for token files some of whose sources have no validation split among
    ``splits`` (so no ``val_loss`` there), or None."""
    if not isinstance(dc, MemmapData) or len(splits) >= len(dc.sources()):
        return None
    scored = {name for name, _, _ in splits}
    missing = [p for n, (p, _) in zip(source_names(dc), dc.sources()) if n not in scored]
    return (f"no validation split {', '.join(f'{p}.val.bin' for p in missing)} (or too "
            "short for one window): no val_loss there; usp-prepare writes one "
            "(--val-fraction)")
