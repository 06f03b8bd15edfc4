"""The trainer's validation (``Validator``: ``should_validate``/``validate``): the validation
loss of the validation splits during the run (``usp.eval.val_loss``) and the passkey grid's
scores (``usp.eval.sharded.PasskeyScore``)."""

from __future__ import annotations

import math

from ..config import DataConfig, MemmapData
from ..data.dataset import source_names
from ..data.batches import RowLayouts
from ..eval.val_loss import LengthLoss, mean_loss
from ..mesh import SPMesh


class Validator:
    """``trainer.eval_every``: the validation loss of the validation ``splits``
    [(name, weight, split)] (``usp.data.dataset.build_validation``) and, with ``passkey``
    (``usp.eval.sharded.PasskeyScore``, ``eval.during_training``), the passkey grid's
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
            out["val_loss"] = mean_loss(model, self.splits, self.batch_per_dp_rank, self.mesh,
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
