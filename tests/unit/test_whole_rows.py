"""``data.packing=whole`` (``usp.data.whole``): rows of whole conversations, never one cut,
padded with no loss; the packing fills rows (< 10% padding on lengths spread from 0.05 to 1x
seq_len), is the same under dp 1 and 2 and after a resume; loss weights of
``trainer.loss_norm=document`` against a hand computation; the refusals."""

from dataclasses import replace

import numpy as np
import pytest
import torch

from usp.config import MemmapData, ModelConfig
from usp.data.dataset import build_dataset, build_validation
from usp.data.files import loss_path
from usp.data.memmap import MemmapTokens
from usp.data.whole import WholeRows, pack
from usp.models.tiling import chunked_lm_loss, lm_loss

from _chat_files import write_chat

L = 64


def _rows(prefix, seed=0, **kw):
    return WholeRows(MemmapTokens(prefix, L, documents=True, windows=False), L, seed=seed, **kw)


def test_rows_hold_whole_conversations_with_their_assistant_labels(tmp_path):
    rng = np.random.default_rng(3)
    lengths = rng.integers(2, 2 * L, 300)  # some longer than a row: dropped
    docs = write_chat(tmp_path / "c", lengths)
    mask = np.fromfile(loss_path(tmp_path / "c"), dtype=np.uint8)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    ds = _rows(tmp_path / "c", weights=True)
    assert ds.dropped == int((lengths > L).sum()) > 0
    seen = []
    b = ds.windows(np.arange(ds.num_windows))
    for r in range(ds.num_windows):
        seg, tok, lab, pos = b.segment_ids[r], b.tokens[r], b.labels[r], b.doc_positions[r]
        ids = ds.docs[ds.ptr[r]:ds.ptr[r + 1]]
        at = 0
        for k, d in enumerate(ids):  # document k of the row: whole, in place, its labels
            n = int(lengths[d])
            assert (seg[at:at + n] == k).all() and pos[at:at + n].tolist() == list(range(n))
            assert tok[at:at + n].tolist() == docs[d].tolist()
            m = mask[starts[d] + 1:starts[d] + n]  # its targets' mask
            want = np.where(m == 1, docs[d][1:], -100).tolist() + [-100]
            assert lab[at:at + n].tolist() == want
            w = b.weights[r, at:at + n]
            assert torch.allclose(w, torch.where(torch.tensor(want) >= 0, 1.0 / max(1, m.sum()),
                                                 0.0))
            at += n
        assert (seg[at:] == len(ids)).all() and (lab[at:] == -100).all()  # padding
        assert (tok[at:] == 0).all() and ds.window_doc_lengths([r])[0][-1] == L - at or at == L
        seen.extend(ids.tolist())
    assert sorted(seen) == np.flatnonzero(lengths <= L).tolist()  # each once, none cut


def test_padding_share_under_ten_percent():
    lengths = np.random.default_rng(0).integers(int(0.05 * 1024), 1024 + 1, 5000)
    docs, ptr = pack(lengths, 1024, seed=0)
    share = 1 - lengths[docs].sum() / ((len(ptr) - 1) * 1024)
    assert sorted(docs.tolist()) == list(range(5000)) and share < 0.10, share


def test_rows_the_same_under_dp_columns_and_a_resume(tmp_path):
    write_chat(tmp_path / "c", np.random.default_rng(1).integers(3, L, 200))
    dc = MemmapData(path=str(tmp_path / "c"), seq_len=L, packing="whole", batch_per_dp_rank=4)
    mc = ModelConfig(rope="per_document")
    one = build_dataset(dc, mc, loss_norm="document")
    two = build_dataset(replace(dc, batch_per_dp_rank=2), mc, loss_norm="document")  # a resume
    for step in (0, 5, 40):  # 40: past an epoch
        whole = one.model_batch(step, 4, 0, 1, None)
        halves = [two.model_batch(step, 2, r, 2, None) for r in (0, 1)]
        for k in ("tokens", "labels", "segment_ids", "doc_positions", "weights"):
            assert torch.equal(getattr(whole, k), torch.cat([getattr(h, k) for h in halves]))
    cols = torch.tensor([[5, 1, 63], [0, 2, 9], [7, 7, 8], [60, 61, 62]])  # [B, n] each row
    part = one.model_batch(3, 4, 0, 1, cols)
    assert torch.equal(part.labels, one.model_batch(3, 4, 0, 1, None).labels.gather(1, cols))
    assert one.padding(range(4))["pad_share"] >= 0.0
    assert torch.equal(_rows(tmp_path / "c", 2).rows(range(8)).tokens,
                       _rows(tmp_path / "c", 2).rows(range(8)).tokens)  # a pure function
    assert not torch.equal(_rows(tmp_path / "c", 2).rows(range(8)).tokens,
                           _rows(tmp_path / "c", 3).rows(range(8)).tokens)  # of the seed


def test_document_weights_give_the_mean_of_each_conversations_mean():
    gen = torch.Generator().manual_seed(0)
    labels = torch.randint(0, 11, (2, 12), generator=gen)
    labels[:, ::3] = -100
    seg = torch.tensor([[0] * 5 + [1] * 7, [0] * 12])
    logits, h = torch.randn(2, 12, 11, generator=gen), torch.randn(2, 12, 8, generator=gen)
    counted = labels != -100
    n = [[int((counted[b] & (seg[b] == k)).sum()) for k in range(2)] for b in range(2)]
    weights = torch.where(counted, 1.0 / torch.tensor(n).gather(1, seg).clamp(min=1), 0.0)
    got, _ = lm_loss(logits, labels, weights)
    each = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(),
                                             reduction="none").view(2, 12)
    hand = sum(each[b][counted[b] & (seg[b] == k)].mean()  # each conversation's own mean
               for b in range(2) for k in range(2) if n[b][k])
    assert abs(got - hand) < 1e-5
    w = torch.randn(11, 8, generator=gen)
    for wt in (weights, None):  # chunked equals whole, forward and gradients
        hw, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        a = chunked_lm_loss(hw, ww, labels, 5, wt)[0]
        a.backward()
        hb, wb = h.clone().requires_grad_(), w.clone().requires_grad_()
        b = lm_loss(torch.nn.functional.linear(hb, wb), labels, wt)[0]
        b.backward()
        assert abs(a - b) < 1e-5 and torch.allclose(hw.grad, hb.grad, atol=1e-6)
        assert torch.allclose(ww.grad, wb.grad, atol=1e-6)


def test_refusals(tmp_path):
    write_chat(tmp_path / "c", [10, 3 * L, 20])
    with pytest.raises(ValueError, match=r"document 1 has 192 tokens > data.seq_len=64"):
        _rows(tmp_path / "c", on_long="error")
    mc = ModelConfig()
    write_chat(tmp_path / "plain", [30] * 10, mask=False)
    write_chat(tmp_path / "other", [30] * 10, kind=None)
    for name, has in (("plain", "no loss mask"), ("other", "a loss mask of kind None")):
        dc = MemmapData(path=str(tmp_path / name), seq_len=L, loss_on="assistant")
        with pytest.raises(ValueError, match=f"data.loss_on=assistant but .* has {has}"):
            build_dataset(dc, mc)
    dc = MemmapData(path=str(tmp_path / "c"), seq_len=L, packing="documents")
    with pytest.raises(ValueError, match="trainer.loss_norm=document .* data.packing=documents"):
        build_dataset(dc, mc, loss_norm="document")
    (tmp_path / "c.docs").unlink()
    with pytest.raises(ValueError, match="data.packing=documents or whole cannot tell"):
        build_dataset(replace(dc, packing="whole"), mc)
    with pytest.raises(ValueError, match="data.on_long"):
        MemmapData(path="x", on_long="cut")


def test_validation_reads_whole_rows(tmp_path):
    write_chat(tmp_path / "c", [40] * 20)
    write_chat(tmp_path / "c.val", [30, 50, 20, 10] * 5, seed=1)
    write_chat(tmp_path / "short.val", [20, 30], seed=2)  # fewer tokens than one row
    write_chat(tmp_path / "short", [20, 30], seed=2)
    dc = MemmapData(path=str(tmp_path / "c"), seq_len=L, packing="whole", loss_on="assistant")
    (_, _, split), = build_validation(dc, ModelConfig(), 3)
    b = split.model_windows([0, 1, 2], None)
    assert split.eval_windows == 3 and b.segment_ids is not None and (b.labels != -100).any()
    with pytest.raises(ValueError, match="holds .* windows"):
        build_validation(dc, ModelConfig(), split.source.num_windows + 1)
    (_, _, short), = build_validation(replace(dc, path=str(tmp_path / "short")), ModelConfig(), 1)
    assert short.model_windows([0], None).segment_ids[0].unique().tolist() == [0, 1, 2]
