"""``assistant_parity``: conversations packed whole with the loss on the assistant's tokens
(``tests/_chat_files.py`` writes them), through a transformers Llama patched by usp, against
transformers' own loss; ``distributed/test_hf_ranks.py`` runs it on each of its layouts."""

from dataclasses import replace

import numpy as np
import torch
import torch.distributed as dist
from _hf_tiny import ROWS, L, tiny_model

import usp.models.hf
from usp.data.batches import RowLayouts
from usp.data.dataset import TrainingData
from usp.data.files import loss_path
from usp.data.indexing import step_indices
from usp.data.memmap import MemmapTokens
from usp.data.whole import WholeRows
from usp.models.forward import loss_and_predictions


def _assistant_reference(ref, ds: WholeRows, prefix: str) -> tuple[float, float]:
    """(token mean, mean of conversation means) of transformers' loss on the conversations
    of the first ROWS rows, each alone, labels -100 where the file's mask is 0."""
    mask = np.fromfile(loss_path(prefix), dtype=np.uint8)
    total, count, means = 0.0, 0, []
    for r in ds.order.lookup(range(ROWS))[1]:
        for d in ds.docs[ds.ptr[r]:ds.ptr[r + 1]]:
            lo, hi = int(ds.starts[d]), int(ds.starts[d] + ds.lengths[d])
            ids = torch.from_numpy(ds.tokens.tokens[lo:hi].astype(np.int64))[None]
            labels = ids.masked_fill(torch.from_numpy(mask[lo:hi] == 0)[None], -100)
            n = int((labels[0, 1:] != -100).sum())  # transformers shifts: targets 1..
            if n:
                loss = float(ref(input_ids=ids, labels=labels).loss)
                total, count = total + loss * n, count + n
                means.append(loss)
    return total / count, sum(means) / len(means)


def _step_loss(model, mesh, data, balance: str, micro: int) -> tuple[float, float]:
    """(token, document) loss of the first ROWS rows on this layout, as the trainer sums and
    normalises them, read as ``micro`` micro-batches."""
    layouts = RowLayouts(mesh, L, balance, torch.device("cpu"),
                         use=lambda lay: usp.models.hf.patch(model, mesh, lay))
    if balance != "per_document":
        usp.models.hf.patch(model, mesh, layouts.sequence)
    stats = torch.zeros(4, dtype=torch.float64)
    per = ROWS // mesh.dp // micro
    for k in range(micro):
        mine = step_indices(0, ROWS // mesh.dp, mesh.dp_rank, mesh.dp)[k * per:(k + 1) * per]
        rows = layouts.rows(data, mine)
        layouts.enter(rows)
        with torch.no_grad():
            doc, _ = loss_and_predictions(model, rows.batch, rows.positions)
            plain = replace(rows.batch, weights=None)
            tok, _ = loss_and_predictions(model, plain, rows.positions)
        stats += torch.tensor([tok, plain.loss_count(), doc, rows.batch.loss_count()],
                              dtype=torch.float64)
    dist.all_reduce(stats)  # over dp x sp, as the trainer's loss group
    return float(stats[0] / stats[1]), float(stats[2] / stats[3].round())


def assistant_parity(mesh, prefix: str) -> None:
    """On ``mesh``, under zigzag and per_document (dp 1: also as two micro-batches), the
    first ROWS packed rows of the conversations at ``prefix`` through a transformers Llama
    patched by usp: ``trainer.loss_norm=token`` and ``document`` within 1e-5 of
    transformers' own loss of each conversation alone with labels -100 outside the
    assistant's tokens (the token mean; the mean of the conversations' means)."""
    model = tiny_model("llama")
    ds = WholeRows(MemmapTokens(prefix, L, documents=True), L, seed=0, weights=True)
    data = TrainingData(ds, packed=True, rope="per_document")
    want = _assistant_reference(tiny_model("llama"), ds, prefix)
    assert abs(want[0] - want[1]) > 1e-3, want  # the two norms tell apart
    for balance in ("zigzag", "per_document"):
        for micro in ((1, 2) if mesh.dp == 1 and balance == "zigzag" else (1,)):
            got = _step_loss(model, mesh, data, balance, micro)
            assert abs(got[0] - want[0]) < 1e-5, (mesh.dp, balance, micro, got, want)
            assert abs(got[1] - want[1]) < 1e-5, (mesh.dp, balance, micro, got, want)
