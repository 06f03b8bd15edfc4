"""Rows of whole documents (``data.packing=whole``): conversations packed, never cut.

A token file's documents (its ``.docs``) of at most ``seq_len`` tokens are packed into rows
of ``seq_len``: each row holds whole documents one after another, then padding. The
packing (``pack``) is best-fit-decreasing over consecutive windows of ``WINDOW``
documents in an order shuffled by ``(seed, phase)``: a pure function of the document
lengths, the seed and the phase (a length phase re-packs at its own ``seq_len``), the same
on every rank, under any dp and accumulation, and after a resume. Training visits the
packed rows in epochs without replacement (``usp.data.order.WindowOrder`` over the rows:
each epoch the same rows in the order ``(seed, phase, epoch)`` fixes).

In a row, document k (in row order) has segment id k and positions restarting at 0; its
last token predicts nothing (label -100), nor does a token whose target the loss mask
leaves out. The padding after the last document is segment id ``k`` = the number of
documents: it attends only to itself, its tokens are 0 and its labels -100, and the
per_document layout sees it as one more document (``doc_lengths``). Documents longer than
``seq_len`` are dropped and counted (``data.on_long=drop``) or refused (``error``).
"""

from __future__ import annotations

import bisect

import numpy as np
import torch

from .order import WindowOrder
from .packing import IGNORE_INDEX, Batch

WINDOW = 4096  # documents packed together (best-fit-decreasing within each window)
PAD_TOKEN = 0  # the id padding reads as (it carries no loss and sees no document)


def _best_fit_decreasing(lengths: np.ndarray, capacity: int) -> list[list[int]]:
    """Indices into ``lengths`` (each <= capacity) grouped into bins of at most ``capacity``:
    the longest first, each into the open bin it fills most tightly (the least room that
    holds it; ties: the older bin), a new bin when none. O(log bins) a document."""
    order = np.argsort(-lengths, kind="stable")
    rooms: list[tuple[int, int]] = []  # (free tokens, bin), sorted
    bins: list[list[int]] = []
    for i in order.tolist():
        n = int(lengths[i])
        at = bisect.bisect_left(rooms, (n, -1))
        if at < len(rooms):
            room, b = rooms.pop(at)
        else:
            room, b = capacity, len(bins)
            bins.append([])
        bins[b].append(i)
        bisect.insort(rooms, (room - n, b))
    return bins


def pack(lengths, seq_len: int, seed: int, phase: int = 0,
         window: int = WINDOW) -> tuple[np.ndarray, np.ndarray]:
    """(docs, row_ptr): row r holds documents ``docs[row_ptr[r]:row_ptr[r + 1]]`` (indices
    into ``lengths``, each of 1..``seq_len`` tokens; longer ones are left out), packed by
    best-fit-decreasing over windows of ``window`` documents in the order ``(seed, phase)``
    shuffles them."""
    lengths = np.asarray(lengths, dtype=np.int64)
    keep = np.flatnonzero((lengths >= 1) & (lengths <= seq_len))
    rng = np.random.default_rng(np.random.SeedSequence([seed & 0xFFFFFFFF, seed >> 32, phase,
                                                        0x3A01E]))
    keep = keep[rng.permutation(keep.size)]
    docs, ptr = [], [0]
    for lo in range(0, keep.size, window):
        part = keep[lo:lo + window]
        for b in _best_fit_decreasing(lengths[part], seq_len):
            docs.extend(part[b].tolist())
            ptr.append(len(docs))
    return np.asarray(docs, dtype=np.int64), np.asarray(ptr, dtype=np.int64)


class WholeRows:
    """Rows of whole documents of ``tokens`` (a ``usp.data.memmap.MemmapTokens`` built with
    ``documents=True``), read like it: ``rows``/``windows``/``doc_lengths``/
    ``window_doc_lengths``, ``order`` and ``num_windows`` (the packed rows).

    ``on_long``: ``drop`` leaves documents over ``seq_len`` out (``dropped`` counts them),
    ``error`` refuses the first one. ``weights``: batches carry each labelled token's weight
    1 / the labelled tokens of its document (``trainer.loss_norm=document``)."""

    def __init__(self, tokens, seq_len: int, seed: int, phase: int = 0, on_long: str = "drop",
                 weights: bool = False, window: int = WINDOW):
        self.tokens, self.seq_len, self.weights = tokens, seq_len, weights
        starts = np.asarray(tokens.doc_starts, dtype=np.int64)
        self.starts = starts
        self.lengths = np.diff(np.append(starts, tokens.num_tokens))  # [D]
        long = np.flatnonzero(self.lengths > seq_len)
        where = tokens.bin_path
        if long.size and on_long == "error":
            i = int(long[0])
            raise ValueError(f"{where}: document {i} has {int(self.lengths[i])} tokens > "
                             f"data.seq_len={seq_len} ({long.size} such of "
                             f"{self.lengths.size}); data.packing=whole never cuts one: set "
                             "data.on_long=drop to leave them out, or raise data.seq_len")
        self.dropped, self.dropped_tokens = int(long.size), int(self.lengths[long].sum())
        self.docs, self.ptr = pack(self.lengths, seq_len, seed, phase, window)
        self.num_windows = len(self.ptr) - 1
        if self.num_windows < 1:
            raise ValueError(f"{where}: no document of 1..data.seq_len={seq_len} tokens to "
                             f"pack ({self.lengths.size} documents, {self.dropped} longer); "
                             "raise data.seq_len")
        self.order = WindowOrder(self.num_windows, seed, phase)
        self.vocab_size = tokens.vocab_size

    @property
    def padding_share(self) -> float:
        """The share of the packed rows' tokens that are padding."""
        used = int(self.lengths[self.docs].sum())
        return 1.0 - used / (self.num_windows * self.seq_len)

    def note(self) -> str:
        """What a run says at its start about the packing."""
        return (f"{self.tokens.bin_path}: {self.lengths.size - self.dropped} documents packed "
                f"whole into {self.num_windows} rows of {self.seq_len} tokens, padding "
                f"{self.padding_share:.1%}; {self.dropped} longer than data.seq_len dropped "
                f"({self.dropped_tokens} tokens)")

    def row_padding(self, samples) -> float:
        """The padding share of the rows of global samples ``samples``."""
        rows = self.order.lookup(samples)[1]
        used = sum(int(self.lengths[self.docs[self.ptr[r]:self.ptr[r + 1]]].sum()) for r in rows)
        return 1.0 - used / (len(rows) * self.seq_len)

    def doc_lengths(self, samples) -> list[tuple[int, ...]]:
        """The document lengths of each row of global samples ``samples``, the padding last
        (each tuple sums to ``seq_len``)."""
        return self.window_doc_lengths(self.order.lookup(samples)[1])

    def window_doc_lengths(self, windows) -> list[tuple[int, ...]]:
        """``doc_lengths`` of the packed rows ``windows`` themselves (in packing order)."""
        out = []
        for r in np.asarray(windows, dtype=np.int64).reshape(-1):
            lens = [int(x) for x in self.lengths[self.docs[self.ptr[r]:self.ptr[r + 1]]]]
            pad = self.seq_len - sum(lens)
            out.append(tuple(lens + ([pad] if pad else [])))
        return out

    def rows(self, samples, positions: torch.Tensor | None = None,
             packed: bool = True) -> Batch:
        """The ``Batch`` of global samples ``samples`` [B] (each the packed row
        ``usp.data.order`` gives it), at the columns ``positions`` ([n] or [B, n]; all when
        None). Always with segment ids and positions inside each document."""
        return self.windows(self.order.lookup(samples)[1], positions)

    def windows(self, windows, positions: torch.Tensor | None = None,
                packed: bool = True) -> Batch:
        """``rows`` for the packed rows ``windows`` [B] themselves (validation: the first)."""
        windows = np.asarray(windows, dtype=np.int64).reshape(-1)
        if windows.size and (windows.min() < 0 or windows.max() >= self.num_windows):
            raise ValueError(f"{self.tokens.bin_path} packs {self.num_windows} rows of "
                             f"{self.seq_len} tokens; asked for [{windows.min()}, "
                             f"{windows.max()}]")
        full = [self._row(int(r)) for r in windows]  # each 5 arrays [L]
        stack = {k: np.stack([f[k] for f in full]) for k in full[0]} if full else {}
        cols = (np.arange(self.seq_len) if positions is None
                else positions.cpu().numpy().astype(np.int64))
        pick = {k: (v[:, cols] if cols.ndim == 1 else np.take_along_axis(v, cols, 1))
                for k, v in stack.items()}  # [B, n]
        src, real = pick["src"], pick["src"] >= 0
        ids = np.full(src.shape, PAD_TOKEN, dtype=np.int64)
        ids[real] = np.asarray(self.tokens.tokens[src[real]]).astype(np.int64)
        self.tokens._check(ids[real], src[real])
        labels = np.full(src.shape, IGNORE_INDEX, dtype=np.int64)
        lab = pick["target"] >= 0
        labels[lab] = np.asarray(self.tokens.tokens[pick["target"][lab]]).astype(np.int64)
        weights = torch.from_numpy(pick["weight"]) if self.weights else None
        return Batch(torch.from_numpy(ids), torch.from_numpy(labels),
                     torch.from_numpy(pick["seg"]), torch.from_numpy(pick["pos"]), weights)

    def _row(self, r: int) -> dict[str, np.ndarray]:
        """Packed row ``r`` whole, each [L]: ``src`` the file offset of each token (-1:
        padding), ``target`` the offset of its label's token (-1: none), ``seg`` the
        segment ids, ``pos`` the positions inside each document, ``weight`` (float32) each
        labelled token's 1 / the labelled tokens of its document."""
        docs = self.docs[self.ptr[r]:self.ptr[r + 1]]
        lens, firsts = self.lengths[docs], self.starts[docs]
        used, pad = int(lens.sum()), self.seq_len - int(lens.sum())
        seg = np.repeat(np.arange(len(docs) + 1), np.append(lens, pad))
        begin = np.repeat(np.cumsum(lens) - lens, lens)  # each token's document's first column
        pos = np.concatenate([np.arange(used) - begin, np.arange(pad)])
        src = np.concatenate([np.repeat(firsts, lens) + pos[:used], np.full(pad, -1)])
        target = np.where(np.append(pos[:used] < np.repeat(lens, lens) - 1,
                                    np.zeros(pad, dtype=bool)), src + 1, -1)
        if self.tokens.loss is not None:  # no loss where the target token is masked out
            t = target >= 0
            target[t] = np.where(np.asarray(self.tokens.loss[target[t]]) == 1, target[t], -1)
        counted = np.bincount(seg[target >= 0], minlength=len(docs) + 1)  # per document
        weight = np.where(target >= 0, 1.0 / np.maximum(counted[seg], 1), 0.0)
        return {"src": src, "target": target, "seg": seg, "pos": pos,
                "weight": weight.astype(np.float32)}
