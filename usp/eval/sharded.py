"""Passkey retrieval through the sharded model, for ``usp-eval`` and the trainer alike:
each length its own ``SequenceLayout``, the cases of one (length, depth) cell in one
forward pass through ``usp_attention`` (no generation, no KV cache), each token's loss and
argmax gathered back to global order and scored by ``usp.eval.passkey.score``.

The model's attention is routed through each length's layout by its ``use(layout)``
(``usp.models.routed``). ``PasskeyScore`` is the trainer's periodic score (``eval.during_training``): the same grid
``usp-eval`` scores (``usp.eval.grid.grid_cases``), at every validation."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed as dist

from ..config import RunConfig
from ..data.packing import Batch
from ..layout import SequenceLayout
from ..mesh import SPMesh
from ..models.forward import token_losses_and_predictions
from . import results
from .grid import passkey_lengths
from .passkey import Case, case_labels, score


def scored(model, layout: SequenceLayout, tokens: torch.Tensor, labels: torch.Tensor, device):
    """(losses [B, L] fp32, predictions [B, L]) of global rows ``tokens``/``labels`` [B, L]:
    this rank's columns through the model, gathered back to global order on every rank."""
    positions = layout.positions(device)  # [L/P] global ids of this rank's tokens
    batch = Batch(tokens=layout.shard(tokens).to(device), labels=layout.shard(labels).to(device))
    losses, preds = token_losses_and_predictions(model, batch, positions)  # [B, L/P] each
    return layout.gather(losses.float()).cpu(), layout.gather(preds).cpu()  # -> [B, L]


@torch.no_grad()
def passkey_scores(model, use, cases: list[Case], mesh: SPMesh, balance: str,
                   device) -> list[dict]:
    """Every case's score (``usp.eval.passkey.score``), the same on every rank of an SP
    group; the cases of one (length, depth) cell in one forward pass, each length through
    its own layout (``use(layout)``; the caller routes it back)."""
    cells = defaultdict(list)
    for case in cases:
        cells[(case.length, case.depth)].append(case)
    scores = []
    for (length, _), cell in cells.items():
        layout = SequenceLayout(mesh, length, balance)
        use(layout)
        tokens = torch.tensor([c.tokens for c in cell])  # [per_cell, L]
        labels = torch.tensor([case_labels(c) for c in cell])  # [per_cell, L]
        losses, preds = scored(model, layout, tokens, labels, device)
        scores += [score(c, losses[i].tolist(), preds[i].tolist()) for i, c in enumerate(cell)]
    return scores


class PasskeyScore:
    """``eval.during_training``: ``score(model)`` (collective over every rank) scores the grid
    through the model on every dp replica, takes rank 0's scores on every rank (a
    broadcast), routes attention back to the training layout, and returns the metrics
    (``usp.eval.results.passkey_metrics``: ``passkey_acc/<L>``, ``passkey_logprob/<L>``);
    rank 0 writes ``passkey.json`` and ``passkey.png`` in ``run_dir`` (the last one stays)."""

    def __init__(self, cfg: RunConfig, cases: list[Case], mesh: SPMesh, use,
                 train_layout: SequenceLayout, run_dir: str, device: torch.device):
        self.cases, self.mesh, self.use, self.train_layout = cases, mesh, use, train_layout
        self.lengths = passkey_lengths(cfg, train_layout.seq_len)
        self.depths, self.key_digits = list(cfg.eval.depths), cfg.eval.key_digits
        self.balance, self.run_dir, self.device = train_layout.balance, Path(run_dir), device
        self.result: dict | None = None  # the last evaluation's passkey.json

    def score(self, model, step: int | None = None) -> dict:
        model.eval()
        try:
            scores = passkey_scores(model, self.use, self.cases, self.mesh, self.balance,
                                    self.device)
        finally:
            self.use(self.train_layout)  # the training steps' layout again
            model.train()
        # Sync: every rank holds rank 0's scores (every dp replica scored the same cases)
        held = [scores]
        dist.broadcast_object_list(held, src=0, group=self.mesh.group("loss"),
                                   device=self.device if self.device.type == "cuda" else None)
        self.result = results.passkey_result(held[0], self.lengths, self.depths,
                                            self.train_layout.seq_len, self.key_digits, step)
        if dist.get_rank() == 0:
            results.write_json(self.run_dir / "passkey.json", self.result)
            results.passkey_png(self.result, self.run_dir / "passkey.png")
        return results.passkey_metrics(self.result)
