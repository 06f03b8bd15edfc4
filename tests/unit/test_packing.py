"""Packed documents and sliding windows in training, one process: the data (document ids,
boundary labels, per-document positions, memmap boundaries), the model (a packed row equals
its documents run alone) and refusals before launch. Across ranks and a short
packed-recall training run: ``distributed/test_packing_ranks.py``."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from usp.config import MemmapData, ModelConfig, ParallelConfig, RecallData, RunConfig
from usp.data import IGNORE_INDEX, MemmapTokens, RecallTask, TokenWriter, docs_path
from usp.data.packing import document_positions
from usp.dims.tokens import Ownership, position_tensor
from usp.data.prepare import EOS, prepare
from usp.models.decoder import Transformer
from usp.data.dataset import build_dataset
from usp.run import check_run_masks

from _packed import LOCAL, MODEL, documents_alone, packed_row


def _four_shards(seq_len):
    """The (ring 2 x ulysses 2) zigzag shards' global columns."""
    owner = Ownership(seq_len, ring=2, ulysses=2, balance="zigzag")
    return [position_tensor(owner.ranges(i, j)) for i in range(2) for j in range(2)]


def _lengths(ids: torch.Tensor) -> list[int]:
    return torch.unique_consecutive(ids, return_counts=True)[1].tolist()


# ---------------------------------------------------------------- data


def test_packed_recall_rows_isolate_conflicting_documents():
    L, D = 512, 4
    task = RecallTask(vocab_size=320, seq_len=L, n_pairs=8, n_queries=8, seed=4,
                      documents_per_row=D)
    b = task.packed_batch(step=1, batch_per_dp_rank=6)
    assert b.tokens.shape == b.segment_ids.shape == b.doc_positions.shape == (6, L)
    V, lengths_seen = task.n_values, set()
    for tok, lab, seg, pos in zip(b.tokens, b.labels, b.segment_ids, b.doc_positions):
        lengths = _lengths(seg)
        assert seg.unique_consecutive().tolist() == list(range(D)) and sum(lengths) == L
        assert min(lengths) >= task.min_document_len
        lengths_seen.add(tuple(lengths))
        starts = np.cumsum([0] + lengths[:-1])
        assert tok[starts].tolist() == [0] * D  # BOS opens each document
        assert torch.equal(pos, torch.cat([torch.arange(m) for m in lengths]))
        held = []  # key -> value of each document's dictionary
        for s, m in zip(starts, lengths):
            part = tok[s : s + m]
            pairs = part[(part >= task.pair_base) & (part < task.filler_base)] - task.pair_base
            kv = {int(p) // V: int(p) % V for p in pairs}
            assert len(kv) == task.n_pairs == len({int(p) for p in pairs})  # one value per key
            held.append(kv)
            asked = (lab[s : s + m] != IGNORE_INDEX).nonzero().flatten() + s
            assert len(asked) == task.n_queries
            for q in asked.tolist():  # the answer is this document's value for the key
                key = int(tok[q]) - task.query_base
                assert int(lab[q]) - task.value_base == kv[key] and lab[q] == tok[q + 1]
        for a, c in zip(held, held[1:]):  # neighbours: the same keys, other values
            assert set(a) == set(c) and all(a[k] != c[k] for k in a)
    assert len(lengths_seen) > 1  # random lengths
    # one document per row: the unpacked rows, ids all 0; shards are columns of the rows
    one = RecallTask(vocab_size=320, seq_len=256, seed=4)
    full = one.packed_batch(2, 3)
    assert torch.equal(full.tokens, one.batch(2, 3)[0]) and not full.segment_ids.any()
    for pos in _four_shards(L):
        part = task.packed_batch(1, 6, positions=pos)
        for got, want in zip(vars(part).values(), vars(b).values()):
            assert got is want is None or torch.equal(got, want[:, pos])  # weights: None


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    src = tmp_path_factory.mktemp("docs")
    files = {f"{i:02d}.txt": bytes([97 + i]) * (5 + 7 * i) for i in range(12)}
    for name, data in files.items():
        (src / name).write_bytes(data)
    out = tmp_path_factory.mktemp("data") / "docs"
    meta = prepare(src, "*.txt", out)
    return out, files, meta


def test_memmap_document_boundaries_round_trip(corpus):
    out, files, meta = corpus
    sizes = [len(files[n]) + 1 for n in sorted(files)]  # each file + EOS
    starts = np.fromfile(docs_path(out), dtype=np.int64)
    assert meta["num_documents"] == len(files) and starts.tolist() == np.cumsum([0] + sizes[:-1]).tolist()
    ds = MemmapTokens(out, seq_len=48, seed=3, documents=True)
    b = ds.packed_batch(step=1, batch_per_dp_rank=5)
    tokens, labels = ds.batch(step=1, batch_per_dp_rank=5)
    assert torch.equal(b.tokens, tokens)
    # a label is dropped exactly where it would cross into the next document: after EOS
    assert torch.equal(b.labels == IGNORE_INDEX, tokens == EOS)
    kept = b.labels != IGNORE_INDEX
    assert torch.equal(b.labels[kept], labels[kept])
    for tok, seg, pos in zip(b.tokens, b.segment_ids, b.doc_positions):
        letters = torch.where(tok == EOS, seg + 97, tok)  # file i holds byte 97 + i
        assert torch.equal(letters, seg + 97)  # the id is the file's index
        assert torch.equal(pos, document_positions(seg[None])[0])  # restart at each document
        assert pos[0] == 0 and (pos == 0).sum() == len(_lengths(seg))
    for p in _four_shards(48):
        part = ds.packed_batch(1, 5, positions=p)
        for got, want in zip(vars(part).values(), vars(b).values()):
            assert got is want is None or torch.equal(got, want[:, p])  # weights: None


def test_refusals_before_launch(corpus, tmp_path):
    out, _, _ = corpus
    with pytest.raises(ValueError, match="model.rope=per_document .* data.packing=none .* "
                                         "set data.packing=documents"):
        build_dataset(RecallData(), ModelConfig(rope="per_document"))
    with pytest.raises(ValueError, match="data.packing='doc' is not one of none, documents"):
        RecallData(packing="doc")
    with pytest.raises(ValueError, match=r"documents_per_row=9 .* >= 68 tokens .* need "
                                         r"seq_len >= 612, got 512.*documents_per_row <= 7"):
        build_dataset(RecallData(documents_per_row=9), ModelConfig())
    # a token file written before boundaries were recorded (no .docs, no num_documents)
    old = tmp_path / "old"
    with TokenWriter(old, 257, "bytes+eos", "test") as w:
        w.write(np.fromfile(f"{out}.bin", dtype=np.uint16))
    assert not docs_path(old).exists() and "num_documents" not in json.loads(
        Path(f"{old}.json").read_text())
    MemmapTokens(old, 16)  # fine without packing
    with pytest.raises(ValueError, match=r"records no document boundaries .* re-run "
                                         r".*usp-prepare"):
        build_dataset(MemmapData(path=str(old), seq_len=64, packing="documents"), ModelConfig())
    # a stale .docs next to a rewritten file is removed, not trusted
    docs_path(old).write_bytes(np.zeros(3, dtype=np.int64).tobytes())
    with TokenWriter(old, 257, "bytes+eos", "test") as w:
        w.write(np.arange(20))
    assert not docs_path(old).exists()
    # masks the kernel / ring engine cannot apply are refused before launch
    cfg = RunConfig(data=RecallData(packing="documents"))
    check_run_masks(cfg)
    with pytest.raises(ValueError, match="data.packing=documents .* ring_impl='ring_flash_attn' "
                                         "cannot apply segment_ids"):
        check_run_masks(replace(cfg, parallel=ParallelConfig(ring_impl="ring_flash_attn")))


# ---------------------------------------------------------------- model


def test_packed_row_equals_documents_alone_one_process():
    tokens, ids = packed_row([5, 11, 1, 15], MODEL["vocab_size"])
    for window in (None, 4):
        cfg = ModelConfig(**MODEL, rope="per_document", sliding_window=window,
                          full_attention_every=2 if window else 0)
        model = Transformer(cfg, LOCAL)
        packed = model(tokens, document_positions(ids), ids)
        assert (packed - documents_alone(model, tokens, ids)).abs().max() <= 1e-4, window
        # the mask is what makes them equal: without it later documents see earlier ones
        unmasked = model(tokens, document_positions(ids))
        assert (unmasked - packed)[:, 5:].abs().max() > 1e-3, window
