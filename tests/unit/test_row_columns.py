"""The data a per_document batch is made of: each row's document lengths, read alike by
every rank from the token file's ``.docs`` (the recall task's rows, a blend's corpora), are
the documents the packed rows' ``segment_ids`` hold; per-row columns [B, n] read exactly
those columns of the global rows, labels shifted on the global sequence first."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from usp.data import MemmapTokens, TokenWriter
from usp.data.blend import Blend
from usp.data.synthetic import RecallTask
from usp.dims.balance import per_document_segments
from usp.dims.tokens import position_tensor

L = 32


def _corpus(prefix, seed: int, base: int = 0) -> None:
    rng = np.random.default_rng(seed)
    with TokenWriter(prefix, 1000, "test", "test") as w:
        for _ in range(40):
            w.write_document(base + rng.integers(1, 400, int(rng.integers(1, 50))))


def _runs(ids: torch.Tensor) -> tuple[int, ...]:
    """Lengths of the runs of equal ids of one row [L]."""
    return tuple(torch.unique_consecutive(ids, return_counts=True)[1].tolist())


def _columns(rows: list[tuple[int, ...]], ring: int = 2) -> torch.Tensor:
    """Ring rank 1's per_document segment of each row: [B, L/ring]."""
    return torch.stack([position_tensor(per_document_segments(d, ring)[1]) for d in rows])


def _same(got, full, cols) -> None:
    for name in ("tokens", "labels", "segment_ids", "doc_positions"):
        want = getattr(full, name)
        assert torch.equal(getattr(got, name), want.gather(1, cols)), name


@pytest.fixture
def corpus(tmp_path):
    _corpus(tmp_path / "a", 0)
    _corpus(tmp_path / "b", 1, base=500)
    return [MemmapTokens(tmp_path / p, L, seed=j, documents=True) for j, p in enumerate("ab")]


def test_token_file_rows_documents_and_own_columns(corpus):
    m, samples = corpus[0], np.arange(6)
    full = m.rows(samples, packed=True)  # [B, L]
    rows = m.doc_lengths(samples)
    assert rows == [_runs(ids) for ids in full.segment_ids]
    assert any(len(d) > 1 for d in rows) and all(sum(d) == L for d in rows)
    assert m.window_doc_lengths(m.order.lookup(samples)[1]) == rows
    cols = _columns(rows)
    _same(m.rows(samples, cols, packed=True), full, cols)  # only these tokens read
    with pytest.raises(ValueError, match="positions \\[B, n\\] of 6 rows for 2 windows"):
        m.windows([0, 1], cols, packed=True)


def test_blend_and_recall_rows_documents_and_own_columns(corpus):
    blend, samples = Blend(corpus, [2, 1], ["a", "b"]), np.arange(6)
    full = blend.rows(samples, packed=True)
    assert blend.doc_lengths(samples) == [_runs(ids) for ids in full.segment_ids]
    cols = _columns(blend.doc_lengths(samples))
    _same(blend.rows(samples, cols, packed=True), full, cols)

    task = RecallTask(vocab_size=320, seq_len=128, n_pairs=4, n_queries=2, seed=3,
                      documents_per_row=3)
    full = task.rows(samples, packed=True)
    rows = task.doc_lengths(samples)
    assert rows == [_runs(ids) for ids in full.segment_ids] and len(rows[0]) == 3
    cols = _columns(rows)
    _same(task.rows(samples, cols, packed=True), full, cols)
