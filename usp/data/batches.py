"""This rank's share of each batch the trainer runs, and the layout it runs on.

Under ``zigzag`` or ``contiguous`` (``RunLayout.balance``) every batch shares the run's one
``SequenceLayout``: the same positions [L/P] select this rank's columns of every row.
Under ``per_document`` each batch gets its own ``DocumentLayout``, made from its rows'
document lengths (the token file's ``.docs``, the recall task's rows), which every rank
reads alike with no communication and no token read; the rank then reads only its own
tokens of each row (positions [B, L/P], also the RoPE positions), and the model's attention
is routed through that layout (``enter``) before the batch runs. Labels are shifted on the
global sequence by the data itself, before any column is selected.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..data.dataset import TrainingData
from ..data.packing import Batch
from ..dims.balance import sequence_balance
from ..layout import DocumentLayout, SequenceLayout
from ..mesh import SPMesh


@dataclass(frozen=True)
class Rows:
    """One batch as this rank runs it: ``batch`` [B, L/P] on the device, the global
    ``positions`` of its tokens ([L/P], or [B, L/P] per row) and the ``layout`` they come
    from."""

    batch: Batch
    positions: torch.Tensor
    layout: SequenceLayout | DocumentLayout


class RowLayouts:
    """The layout of every batch of a run of ``balance`` at ``seq_len`` on ``mesh``.

    ``sequence``: the layout of rows that are one sequence (passkey cases, and every batch
    unless per_document: ``usp.dims.balance.sequence_balance``); ``rows``/``windows``: a
    batch of global samples / of a token file's windows, read at this rank's columns;
    ``enter(rows)``: route the model's attention (``use``) through the batch's layout
    (per_document only; otherwise the run's one layout stays where it is)."""

    def __init__(self, mesh: SPMesh, seq_len: int, balance: str, device: torch.device,
                 use: Callable | None = None):
        self.mesh, self.device, self.use = mesh, device, use
        self.per_document = balance == "per_document"
        self.sequence = SequenceLayout(mesh, seq_len=seq_len, balance=sequence_balance(balance))
        self.positions = self.sequence.positions(device)  # [L/P] global ids of this rank's tokens

    def rows(self, data: TrainingData, samples) -> Rows:
        """Global samples ``samples`` of ``data`` (``model_rows``) at this rank's columns."""
        return self._read(lambda positions: data.model_rows(samples, positions),
                          lambda: data.doc_lengths(samples))

    def windows(self, data: TrainingData, windows) -> Rows:
        """The token file's windows ``windows`` (``model_windows``; validation) at this
        rank's columns."""
        return self._read(lambda positions: data.model_windows(windows, positions),
                          lambda: data.window_doc_lengths(windows))

    def _read(self, read: Callable, doc_lengths: Callable) -> Rows:
        """``read(positions)`` at the run's one layout, or under per_document at the layout of
        the rows' documents (``doc_lengths()``, read only then)."""
        if not self.per_document:
            return Rows(read(self.positions).to(self.device), self.positions, self.sequence)
        layout = DocumentLayout(self.mesh, doc_lengths())
        positions = layout.positions(self.device)  # [B, L/P]
        return Rows(read(positions).to(self.device), positions, layout)

    def enter(self, rows: Rows) -> None:
        """Before ``rows`` runs through the model: its attention on ``rows.layout``."""
        if self.per_document:
            self.use(rows.layout)
