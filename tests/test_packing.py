"""Packed documents and sliding windows in training: the data (document ids, boundary
labels, per-document positions, memmap boundaries), the model (a packed row equals its
documents run alone, one process and across ulysses x ring), refusals before launch, and
a short packed-recall training run at (2, 2)."""

from __future__ import annotations

import functools
import json
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.distributed as dist

from usp.config import (LoggingConfig, MemmapData, ModelConfig, OptimConfig, ParallelConfig,
                        RecallData, RunConfig, TrainerConfig)
from usp.data import IGNORE_INDEX, MemmapTokens, RecallTask, TokenWriter, docs_path
from usp.data.packing import document_positions
from usp.data.prepare import EOS, prepare
from usp.attention import local_attention
from usp.layout import SequenceLayout
from usp.models.llama import Transformer
from usp.data.dataset import build_dataset
from usp.run import check_run_masks


def _four_shards(seq_len):
    """The (ring 2 x ulysses 2) zigzag shards' global columns."""
    layout = SequenceLayout(SimpleNamespace(ulysses=2, ring=2, sp_size=4), seq_len, "zigzag")
    return [layout.indices(i, j) for i in range(2) for j in range(2)]

MODEL = dict(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48)
LOCAL = functools.partial(local_attention, causal=True)


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
            assert torch.equal(got, want[:, pos])


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
            assert torch.equal(got, want[:, p])


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
                                         r".*python -m usp.data.prepare"):
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


def _packed_row(lengths, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (1, sum(lengths)), generator=g)
    ids = torch.cat([torch.full((m,), d) for d, m in enumerate(lengths)])[None]  # [1, L]
    return tokens, ids


def _alone(model, tokens, ids):
    """Each document of the row run on its own, RoPE from 0: logits [1, L, V]."""
    parts = [model(tokens[:, ids[0] == d], torch.arange(int((ids[0] == d).sum())))
             for d in ids[0].unique()]
    return torch.cat(parts, dim=1)


def test_packed_row_equals_documents_alone_one_process():
    tokens, ids = _packed_row([5, 11, 1, 15], MODEL["vocab_size"])
    for window in (None, 4):
        cfg = ModelConfig(**MODEL, rope="per_document", sliding_window=window,
                          full_attention_every=2 if window else 0)
        model = Transformer(cfg, LOCAL)
        packed = model(tokens, document_positions(ids), ids)
        assert (packed - _alone(model, tokens, ids)).abs().max() <= 1e-4, window
        # the mask is what makes them equal: without it later documents see earlier ones
        unmasked = model(tokens, document_positions(ids))
        assert (unmasked - packed)[:, 5:].abs().max() > 1e-3, window


def _sp_worker(run_dir):
    """(2, 2) SP model vs one process (packed, windows) and vs documents alone; then a
    packed recall run that learns."""
    from usp import SPMesh, usp_attention
    from usp.train.trainer import train

    L = 64
    tokens, ids = _packed_row([9, 20, 1, 6, 28], MODEL["vocab_size"], seed=1)
    tokens, ids = tokens.repeat(2, 1), ids.repeat(2, 1)
    ids[1] = torch.cat([torch.zeros(40), torch.ones(24)]).long()  # rows pack differently
    pos = document_positions(ids)
    with SPMesh.build(ulysses=2, ring=2, ranks_per_node=2) as mesh:
        for balance in ("zigzag", "contiguous"):
            lay = SequenceLayout(mesh, seq_len=L, balance=balance)
            sp = functools.partial(usp_attention, mesh=mesh, layout=lay, causal=True)
            for window in (None, 6, 40):
                cfg = ModelConfig(**MODEL, rope="per_document", sliding_window=window)
                one = Transformer(cfg, LOCAL)
                want = one(tokens, pos, ids)
                got = lay.gather(Transformer(cfg, sp)(lay.shard(tokens), lay.shard(pos),
                                                      lay.shard(ids)))
                assert (got - want).abs().max() <= 1e-4, (balance, window)
                if window is None:
                    assert (got[:1] - _alone(one, tokens[:1], ids[:1])).abs().max() <= 1e-4
    cfg = RunConfig(
        model=ModelConfig(vocab_size=320, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                          ffn_dim=128, rope="per_document"),
        parallel=ParallelConfig(ranks_per_node=2),
        data=RecallData(seq_len=256, batch_per_dp_rank=4, n_pairs=4, n_queries=4,
                        documents_per_row=4, packing="documents", eval_batches=1),
        optim=OptimConfig(lr=3e-3, warmup_steps=3),
        trainer=TrainerConfig(steps=20, run_dir=run_dir, nprocs=4, ckpt_every=0),
        logging=LoggingConfig(wandb="disabled", jsonl=True, plot=False, progress=False),
    )
    summary = train(cfg)
    assert 0.0 <= summary["eval_acc"] <= 1.0
    dist.barrier()


def test_packed_model_across_ranks_and_training(tmp_path):
    from usp.launch import spawn_local

    spawn_local(_sp_worker, 4, str(tmp_path))
    hist = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [h["step"] for h in hist] == list(range(1, 21))
    first = sum(h["loss"] for h in hist[:3]) / 3
    last = sum(h["loss"] for h in hist[-3:]) / 3
    assert last < 0.6 * first, (first, last)
