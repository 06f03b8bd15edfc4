"""Single-process tests of usp.data: the recall task, memmap tokens, and ``prepare`` (the
library behind usp-prepare)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from usp.data import IGNORE_INDEX, MemmapTokens, RecallTask, TokenWriter, answer_accuracy
from usp.dims.tokens import Ownership, position_tensor, segment_ranges
from usp.data.prepare import list_files, prepare

L = 256


def _four_shards(seq_len):
    """Zigzag-like split of [0, L) into 4 non-contiguous pieces (ring=2 x ulysses=2)."""
    owner = Ownership(seq_len, ring=2, ulysses=2, balance="zigzag")
    return [position_tensor(owner.ranges(i, j)) for i in range(2) for j in range(2)]


# ---------------------------------------------------------------- recall task


def test_recall_labels_are_next_token_answers_and_survive_sharding():
    task = RecallTask(vocab_size=256, seq_len=L, n_pairs=8, n_queries=6, seed=3)
    tokens, labels = task.batch(step=0, batch_per_dp_rank=4)
    assert tokens.shape == labels.shape == (4, L) and tokens.dtype == labels.dtype == torch.long
    scored = labels != IGNORE_INDEX
    assert scored.sum(1).tolist() == [6, 6, 6, 6]
    assert torch.equal(labels[:, :-1][scored[:, :-1]], tokens[:, 1:][scored[:, :-1]])
    assert not scored[:, -1].any() and not scored[:, : task.query_start + 1].any()
    vals = labels[scored]
    assert ((vals >= task.value_base) & (vals < task.query_base)).all()
    # split into 4 zigzag shards: every column (and every answer) lands on exactly one
    shards = _four_shards(L)
    assert sorted(torch.cat(shards).tolist()) == list(range(L))
    total = 0
    for pos in shards:
        t, lab = task.batch(step=0, batch_per_dp_rank=4, positions=pos)
        assert torch.equal(t, tokens[:, pos]) and torch.equal(lab, labels[:, pos])
        total += int((lab != IGNORE_INDEX).sum())
    assert total == int(scored.sum())


def test_recall_answers_match_pairs_far_back():
    task = RecallTask(vocab_size=256, seq_len=L, n_pairs=8, n_queries=8, seed=0)
    assert (task.n_keys, task.n_values) == (8, 8)
    assert task.min_distance >= L // 2 - 2 * task.n_queries
    tokens, labels = task.batch(step=5, batch_per_dp_rank=3)
    V = task.n_values
    closest = L
    for row, lab in zip(tokens.tolist(), labels.tolist()):
        pairs = {}
        for pos, tok in enumerate(row):
            if task.pair_base <= tok < task.filler_base:
                k, v = divmod(tok - task.pair_base, V)
                assert pairs.setdefault(k, (v, pos))[0] == v  # one value per key
                pairs[k] = (v, pos)  # keep the last occurrence (the closest)
        assert len(pairs) == 8
        for pos, tok in enumerate(row):
            if task.query_base <= tok < task.pair_base:
                v, pair_pos = pairs[tok - task.query_base]
                assert lab[pos] == task.value_base + v
                closest = min(closest, pos - pair_pos)
    assert closest >= task.min_distance >= L // 2 - 16
    # density 1: the whole dictionary region holds pairs; density 0: each pair exactly once
    is_pair = (tokens >= task.pair_base) & (tokens < task.filler_base)
    assert is_pair.sum(1).tolist() == [L // 4] * 3
    sparse = RecallTask(vocab_size=256, seq_len=L, n_pairs=8, n_queries=8, pair_density=0.0)
    t = sparse.batch(0, 3)[0]
    assert ((t >= sparse.pair_base) & (t < sparse.filler_base)).sum(1).tolist() == [8] * 3


def test_recall_pairs_and_queries_sit_in_different_ring_segments():
    task = RecallTask(vocab_size=256, seq_len=L, n_pairs=8, n_queries=8, seed=1)
    tokens, _ = task.batch(step=0, batch_per_dp_rank=2)
    is_pair = (tokens >= task.pair_base) & (tokens < task.filler_base)
    is_query = (tokens >= task.query_base) & (tokens < task.pair_base)
    for ring in (2, 4):
        for balance in ("contiguous", "zigzag"):
            owners = [position_tensor(segment_ranges(L, ring, balance, i)) for i in range(ring)]
            q_seg = [i for i, pos in enumerate(owners) if is_query[:, pos].any()]
            assert len(q_seg) == 1, (ring, balance)
            assert not is_pair[:, owners[q_seg[0]]].any(), (ring, balance)


def test_recall_is_deterministic_and_dp_split_invariant():
    task = RecallTask(vocab_size=256, seq_len=L, n_pairs=8, n_queries=8, seed=7)
    a, b = task.batch(3, 4), task.batch(3, 4)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(task.batch(4, 4)[0], a[0])
    r0, r1 = task.batch(3, 2, dp_rank=0, dp_size=2), task.batch(3, 2, dp_rank=1, dp_size=2)
    assert not torch.equal(r0[0], r1[0])
    # the global batch of step 3 (samples 12..15) is the same whether 1 or 2 dp ranks draw it
    assert torch.equal(torch.cat([r0[0], r1[0]]), a[0])
    assert torch.equal(torch.cat([r0[1], r1[1]]), a[1])
    assert not torch.equal(RecallTask(256, L, 8, 8, seed=8).batch(3, 4)[0], a[0])


def test_recall_chance_and_answer_accuracy():
    task = RecallTask(vocab_size=256, seq_len=L, n_pairs=8, n_queries=8, seed=2)
    assert task.chance_accuracy == pytest.approx(1 / 8)
    _, labels = task.batch(0, 64)  # 512 answers
    logits = torch.zeros(*labels.shape, 256)
    logits[..., task.value_base] = 1.0  # always answer val(0)
    correct, answers = answer_accuracy(logits, labels)
    assert answers.item() == 512 and correct.dtype == torch.long
    assert abs(correct.item() / answers.item() - task.chance_accuracy) < 0.05
    oracle = torch.nn.functional.one_hot(labels.clamp(min=0), 256).float()
    assert answer_accuracy(oracle, labels)[0].item() == 512
    # predictions [B, n] (the chunked loss path) count the same as the logits they come from
    assert torch.equal(answer_accuracy(logits.argmax(-1), labels)[0], correct)
    assert answer_accuracy(labels.clamp(min=0), labels)[0].item() == 512


def test_recall_refuses_bad_sizes_with_numbers():
    with pytest.raises(ValueError, match=r"vocab_size 64 too small.*K\*V=128"):
        RecallTask(vocab_size=64, seq_len=L, n_pairs=16, n_queries=4, n_values=8)
    with pytest.raises(ValueError, match=r"n_queries \(9\) <= n_pairs \(8\)"):
        RecallTask(vocab_size=256, seq_len=L, n_pairs=8, n_queries=9)
    with pytest.raises(ValueError, match=r"2\*n_queries\+1 = 17 tokens.*seq_len 64 \(16"):
        RecallTask(vocab_size=256, seq_len=64, n_pairs=8, n_queries=8)
    with pytest.raises(ValueError, match=r"8 pairs do not fit in positions \[4, 8\)"):
        RecallTask(vocab_size=256, seq_len=16, n_pairs=8, n_queries=1)


# ---------------------------------------------------------------- memmap + prepare_data


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    src = tmp_path_factory.mktemp("text")
    (src / "sub").mkdir()
    files = {"b.txt": b"hello world\n" * 40, "a.txt": bytes(range(256)) * 3,
             "sub/c.txt": "caf\u00e9 \u2603\n".encode() * 50}
    for name, data in files.items():
        (src / name).write_bytes(data)
    (src / "skip.md").write_bytes(b"not matched")
    out = tmp_path_factory.mktemp("data") / "corpus"
    prepare(src, "**/*.txt", out, val_fraction=0)
    return SimpleNamespace(src=src, out=out, files=files)


def test_prepare_data_roundtrip(corpus):
    meta = json.loads(Path(f"{corpus.out}.json").read_text())
    raw = np.fromfile(f"{corpus.out}.bin", dtype=np.uint16)
    want = []
    for name in sorted(corpus.files):  # a.txt, b.txt, sub/c.txt
        want += list(corpus.files[name]) + [256]
    assert raw.tolist() == want
    assert meta["num_tokens"] == len(want) and meta["vocab_size"] == 257
    assert meta["dtype"] == "uint16" and meta["eos_id"] == 256 and meta["max_token"] == 256
    assert meta["source"]["num_files"] == 3 and meta["tokenizer"] == "bytes+eos"
    assert not list(Path(corpus.out).parent.glob("*.tmp"))
    capped = prepare(corpus.src, "**/*.txt", corpus.out.parent / "cap", 800, val_fraction=0)
    assert capped["num_tokens"] == 800 + 2 and capped["source"]["num_bytes"] == 800


def test_prepare_refuses_bad_input_before_writing(corpus, tmp_path):
    names = [p.relative_to(corpus.src).as_posix() for p in list_files(corpus.src, "**/*.txt")]
    assert names == ["a.txt", "b.txt", "sub/c.txt"]  # sorted by relative path, .md left out
    out = tmp_path / "never"
    with pytest.raises(ValueError, match=r"'.*missing' is not a directory.*--src"):
        prepare(tmp_path / "missing", "**/*.txt", out)
    with pytest.raises(ValueError, match=r"no files under .* match the pattern '\*\*/\*\.rst'"):
        prepare(corpus.src, "**/*.rst", out)
    with pytest.raises(ValueError, match=r"max_bytes=-1 is negative"):
        prepare(corpus.src, "**/*.txt", out, max_bytes=-1)
    assert not list(tmp_path.iterdir())  # refused before TokenWriter made any file


def test_memmap_windows_labels_and_positions(corpus):
    ds = MemmapTokens(corpus.out, seq_len=64, seed=1)
    mm = np.fromfile(f"{corpus.out}.bin", dtype=np.uint16).astype(np.int64)
    tokens, labels = ds.batch(step=2, batch_per_dp_rank=3)
    assert tokens.shape == labels.shape == (3, 64) and tokens.dtype == torch.long
    for i in range(3):
        s = ds.window_start(2 * 3 + i)
        assert torch.equal(tokens[i], torch.from_numpy(mm[s : s + 64]))
        assert torch.equal(labels[i], torch.from_numpy(mm[s + 1 : s + 65]))
    # sharded reads equal slicing the full window; the last label is the token after it
    for pos in _four_shards(64):
        t, lab = ds.batch(step=2, batch_per_dp_rank=3, positions=pos)
        assert torch.equal(t, tokens[:, pos]) and torch.equal(lab, labels[:, pos])
    assert torch.equal(labels[:, :-1], tokens[:, 1:])
    assert torch.equal(ds.batch(2, 3)[0], tokens) and not torch.equal(ds.batch(3, 3)[0], tokens)
    r1 = ds.batch(2, 3, dp_rank=1, dp_size=2)[0]
    assert not torch.equal(ds.batch(2, 3, dp_rank=0, dp_size=2)[0], r1)


def test_memmap_reads_only_own_tokens(corpus):
    ds = MemmapTokens(corpus.out, seq_len=64)
    seen = []

    class Spy:
        def __getitem__(self, idx):
            seen.append(np.asarray(idx).ravel())
            return ds_mm[idx]

    ds_mm, ds.tokens = ds.tokens, Spy()
    pos = _four_shards(64)[1]
    ds.batch(0, 1, positions=pos)
    s = ds.window_start(0)
    want = set((s + pos).tolist()) | set((s + pos + 1).tolist())
    assert set(np.concatenate(seen).tolist()) == want and len(want) < 40


def _write(prefix, ids, **meta):
    ids = np.asarray(ids, dtype=np.uint16)
    Path(f"{prefix}.bin").write_bytes(ids.tobytes())
    base = {"dtype": "uint16", "num_tokens": len(ids), "vocab_size": 300,
            "tokenizer": "test", "source": "test"}
    Path(f"{prefix}.json").write_text(json.dumps({**base, **meta}))


def test_memmap_errors_name_path_and_numbers(tmp_path):
    p = tmp_path / "d"
    with pytest.raises(FileNotFoundError, match=r"d\.bin not found.*usp-prepare"):
        MemmapTokens(p, 8)
    _write(p, range(100))
    Path(f"{p}.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"d\.json not found.*usp-prepare"):
        MemmapTokens(p, 8)
    Path(f"{p}.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"d\.json is not valid JSON"):
        MemmapTokens(p, 8)
    Path(f"{p}.json").write_text(json.dumps({"dtype": "uint16", "num_tokens": 100}))
    with pytest.raises(ValueError, match=r"lacks keys \['vocab_size', 'tokenizer', 'source'\]"):
        MemmapTokens(p, 8)
    _write(p, range(100), dtype="int8")
    with pytest.raises(ValueError, match=r"dtype 'int8'"):
        MemmapTokens(p, 8)
    _write(p, range(100), num_tokens=120)
    with pytest.raises(ValueError, match=r"has 200 bytes.*num_tokens=120 x 2 bytes.*240"):
        MemmapTokens(p, 8)
    _write(p, range(100))
    with pytest.raises(ValueError, match=r"holds 100 tokens, fewer than seq_len \+ 1 = 129"):
        MemmapTokens(p, 128)
    _write(p, list(range(50)) + [299, 300] + list(range(48)))
    with pytest.raises(ValueError, match=r"token id 300 at offset 51 is >= vocab_size 300"):
        MemmapTokens(f"{p}.bin", 8)
    ds = MemmapTokens(f"{p}.json", 98, verify=False)  # every window covers offset 51
    with pytest.raises(ValueError, match=r"token id 300 at offset 51"):
        ds.batch(0, 1)
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 10\), got \[0, 12\]"):
        with TokenWriter(tmp_path / "w", 10, "test", "test") as w:
            w.write([0, 12])
    assert not list(tmp_path.glob("w*"))
