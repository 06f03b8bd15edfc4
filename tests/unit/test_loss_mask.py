"""Token files with a loss mask (``{prefix}.loss``, one byte a token): ``TokenWriter`` writes
it, ``MemmapTokens`` gives -100 for a label whose target is masked out (plain and packed
rows, any columns) unless ``data.loss_on=all``, the start notes say what share counts, and
``tools.passkey_corpus --tokens --mask-first-key`` masks exactly the needle's first key."""

import json

import numpy as np
import pytest
import torch

from usp.config import MemmapData
from usp.data.dataset import loss_notes
from usp.data.files import TokenWriter, loss_path
from usp.data.memmap import MemmapTokens


def _files(prefix, docs, masks):
    with TokenWriter(prefix, 50, "bytes+eos", {"test": 1}, loss_mask=masks is not None) as w:
        for i, doc in enumerate(docs):
            w.write_document(doc, None if masks is None else masks[i])
    return json.loads(prefix.with_name(prefix.name + ".json").read_text())


def test_masked_targets_give_no_label_and_loss_on_all_reads_them(tmp_path):
    docs = [np.arange(1, 9), np.arange(11, 19)]  # two documents of 8 tokens
    masks = [np.array([1, 1, 0, 1, 1, 1, 1, 0]), np.array([0, 1, 1, 1, 0, 1, 1, 1])]
    meta = _files(tmp_path / "x", docs, masks)
    assert meta["loss_mask"] is True and meta["loss_tokens"] == 12
    assert loss_path(tmp_path / "x").read_bytes() == np.concatenate(masks).astype(np.uint8).tobytes()
    ds = MemmapTokens(tmp_path / "x", 4, documents=True)
    b = ds.windows([0, 2])  # tokens 0-3 (+4) and 8-11 (+12)
    assert b.labels.tolist() == [[2, -100, 4, 5], [12, 13, 14, -100]]
    b = ds.windows([1], torch.tensor([1, 3]), packed=True)  # tokens 5 and 7: 7's target is doc 2
    assert b.labels.tolist() == [[7, -100]]
    plain = MemmapTokens(tmp_path / "x", 4, loss=False)
    assert plain.loss is None and plain.windows([0]).labels.tolist() == [[2, 3, 4, 5]]
    assert ds.loss_share() == 12 / 16
    dc = MemmapData(path=str(tmp_path / "x"), seq_len=4)
    assert loss_notes(dc) == [f"{tmp_path / 'x'}: loss on 75.0% of the tokens, as its loss mask "
                              "says (x.loss; data.loss_on=all counts every token)"]
    dc.loss_on = "all"
    assert loss_notes(dc) == []


def test_a_mask_that_does_not_fit_is_refused_and_a_rewrite_without_one_removes_it(tmp_path):
    with pytest.raises(ValueError, match="0/1, one per token"):
        _files(tmp_path / "x", [np.arange(4)], [np.array([1, 1, 0])])
    assert not loss_path(tmp_path / "x").exists()
    _files(tmp_path / "x", [np.arange(8)], [np.ones(8)])
    loss_path(tmp_path / "x").write_bytes(b"\x01" * 5)  # truncated
    with pytest.raises(ValueError, match=r"x.loss has 5 bytes, not one byte for each of its 8 "
                                         r"tokens.*data.loss_on=all"):
        MemmapTokens(tmp_path / "x", 4)
    assert MemmapTokens(tmp_path / "x", 4, loss=False).windows([0]).labels.shape == (1, 4)
    _files(tmp_path / "x", [np.arange(8)], None)  # the same prefix, no mask now
    assert not loss_path(tmp_path / "x").exists()
    assert MemmapTokens(tmp_path / "x", 4).loss is None
    with pytest.raises(ValueError, match="data.loss_on"):
        MemmapData(path="x", loss_on="everything")


def test_passkey_tokens_mask_the_needles_first_key_only(tmp_path):
    from tools.passkey_corpus import main

    assert main(["--tokens", str(tmp_path / "pk"), "--docs", "60", "--chars", "96", "--exact",
                 "--digits", "2", "--seed", "3", "--mask-first-key", "--val-fraction", "0.2"]) == 0
    tokens = np.fromfile(tmp_path / "pk.bin", dtype=np.uint16).reshape(-1, 96)
    mask = np.fromfile(tmp_path / "pk.loss", dtype=np.uint8).reshape(-1, 96)
    assert (tmp_path / "pk.val.loss").is_file()
    for row, m in zip(tokens, mask):
        text = bytes(row.astype(np.uint8)).decode()
        at = text.index("The pass key is ") + len("The pass key is ")
        assert np.flatnonzero(m == 0).tolist() == [at, at + 1]  # the two digits, once
        assert text[at:at + 2] == text[-2:]  # the key the answer repeats
