"""Training windows from memory-mapped token files (``usp.data.files`` says what the files
hold; ``usp-prepare`` writes them).

The file is cut into non-overlapping windows of ``seq_len`` tokens, each read with the
token after it so the label of the last position is the token after the window; training
visits them in epochs without replacement (``usp.data.order``). With ``positions`` a rank
reads only the tokens it owns (and their successors): the same columns of every row [n],
or each row its own [B, n] (per_document balance, from the rows' ``doc_lengths``).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from .files import DOC_DTYPE, DTYPES, PREPARE_HINT, data_paths, docs_path, loss_path, read_meta
from .indexing import step_indices
from .order import WindowOrder
from .packing import IGNORE_INDEX, Batch, ignore_crossing

_SCAN_CHUNK = 1 << 24  # tokens per chunk when verifying ids


class MemmapTokens:
    """``seq_len`` windows of a token file in epochs, labels shifted on the global sequence.

    ``path`` is the prefix (``data/x`` for ``data/x.bin`` + ``data/x.json``) or either file.
    ``verify`` scans the whole file once for ids >= vocab_size (chunked; pass False for
    huge corpora, every batch is still checked). Raises FileNotFoundError for a missing
    file and ValueError for bad metadata, a size mismatch, a file shorter than
    ``seq_len + 1`` tokens, or out-of-range ids; every message names the file and numbers.
    ``documents``: load the document boundaries for ``packed_batch`` (ValueError when the
    file records none, or they do not fit the tokens). ``phase``: the length phase whose
    passes the windows are read in (``usp.data.order``; 0 for a run without phases).
    ``loss``: when the files carry a loss mask (``{prefix}.loss``, ``usp.data.files``), a
    label whose target token is masked out is -100 (``data.loss_on=auto``); False reads every
    label (``data.loss_on=all``). ``self.loss`` is the mask in use, or None. ``windows``:
    False for a reader of documents only (``usp.data.whole``): no windows, so no minimum
    length.
    """

    def __init__(self, path: str | os.PathLike, seq_len: int, seed: int = 0, verify: bool = True,
                 documents: bool = False, phase: int = 0, loss: bool = True,
                 windows: bool = True):
        self.bin_path, self.json_path = data_paths(path)
        prefix = self.bin_path.with_suffix("")
        if not self.bin_path.is_file():
            raise FileNotFoundError(
                f"token file {self.bin_path} not found; create it with: "
                f"{PREPARE_HINT.format(prefix=prefix)}"
            )
        self.meta = read_meta(self.json_path, prefix)
        self.seq_len, self.seed = seq_len, seed
        self.vocab_size = int(self.meta["vocab_size"])
        self.num_tokens = int(self.meta["num_tokens"])
        dtype = np.dtype(DTYPES[self.meta["dtype"]])
        expected, actual = self.num_tokens * dtype.itemsize, self.bin_path.stat().st_size
        if actual != expected:
            raise ValueError(
                f"{self.bin_path} has {actual} bytes but {self.json_path} says num_tokens="
                f"{self.num_tokens} x {dtype.itemsize} bytes ({self.meta['dtype']}) = {expected}: "
                f"truncated or corrupt; recreate with: {PREPARE_HINT.format(prefix=prefix)}"
            )
        if windows and self.num_tokens < seq_len + 1:
            raise ValueError(
                f"{self.bin_path} holds {self.num_tokens} tokens, fewer than seq_len + 1 = "
                f"{seq_len + 1} needed for one window; use more data or a shorter seq_len"
            )
        if int(self.meta.get("max_token", -1)) >= self.vocab_size:
            raise ValueError(f"{self.json_path}: max_token {self.meta['max_token']} >= "
                             f"vocab_size {self.vocab_size}")
        self.tokens = np.memmap(self.bin_path, dtype=dtype, mode="r", shape=(self.num_tokens,))
        if verify:
            for lo in range(0, self.num_tokens, _SCAN_CHUNK):
                self._check(self.tokens[lo : lo + _SCAN_CHUNK], lo)
        self.doc_starts = self._load_documents(prefix) if documents else None
        self.loss = self._load_loss(prefix) if loss and self.meta.get("loss_mask") else None
        # non-overlapping windows, each read with the token after it; the remainder dropped
        self.num_windows = (self.num_tokens - 1) // seq_len
        # a length phase's own passes
        self.order = WindowOrder(self.num_windows, seed, phase) if windows else None

    def _load_documents(self, prefix: Path) -> np.ndarray:
        """The document start offsets [num_documents] int64 (read lazily from ``.docs``)."""
        docs, n = docs_path(self.bin_path), self.meta.get("num_documents")
        fix = f"re-run usp-prepare, which records them: {PREPARE_HINT.format(prefix=prefix)}"
        if n is None or not docs.is_file():
            raise ValueError(f"{self.json_path} records no document boundaries (no "
                             f"num_documents / {docs.name}), so data.packing=documents or "
                             f"whole cannot tell documents apart; {fix}; or use "
                             "data.packing=none")
        if docs.stat().st_size != int(n) * DOC_DTYPE.itemsize or int(n) < 1:
            raise ValueError(f"{docs} has {docs.stat().st_size} bytes but {self.json_path} says "
                             f"num_documents={n} x {DOC_DTYPE.itemsize}: truncated or stale; {fix}")
        starts = np.memmap(docs, dtype=DOC_DTYPE, mode="r", shape=(int(n),))
        if starts[0] != 0 or starts[-1] >= self.num_tokens or (np.diff(starts) <= 0).any():
            raise ValueError(f"{docs}: document starts must increase from 0 and stay below "
                             f"num_tokens={self.num_tokens}; {fix}")
        return starts

    def _load_loss(self, prefix: Path) -> np.ndarray:
        """The loss mask [num_tokens] uint8 (read lazily from ``.loss``)."""
        path = loss_path(self.bin_path)
        if not path.is_file() or path.stat().st_size != self.num_tokens:
            have = f"{path.stat().st_size} bytes" if path.is_file() else "no file"
            raise ValueError(f"{self.json_path} says loss_mask but {path} has {have}, not one "
                             f"byte for each of its {self.num_tokens} tokens: truncated or "
                             "stale; write the files again, or read every label with "
                             "data.loss_on=all")
        return np.memmap(path, dtype=np.uint8, mode="r", shape=(self.num_tokens,))

    def loss_share(self) -> float | None:
        """The share of tokens the loss mask keeps as targets (None: no mask in use)."""
        if self.loss is None:
            return None
        return int(self.meta.get("loss_tokens", int(self.loss.sum()))) / self.num_tokens

    def _check(self, ids: np.ndarray, offsets) -> None:
        # offsets: an int (ids is a contiguous run from there) or an array shaped like ids
        bad = np.flatnonzero(ids.ravel() >= self.vocab_size)
        if bad.size:
            i = int(bad[0])
            at = offsets + i if isinstance(offsets, int) else int(np.ravel(offsets)[i])
            raise ValueError(
                f"{self.bin_path}: token id {int(ids.ravel()[i])} at offset {at} is >= "
                f"vocab_size {self.vocab_size} from {self.json_path}; the file does not match "
                f"its metadata (recreate it, or fix vocab_size)"
            )

    def window_start(self, index: int) -> int:
        """First token of global sample ``index``: its window (``usp.data.order``) x seq_len."""
        return int(self.order.lookup([index])[1][0]) * self.seq_len

    def batch(
        self,
        step: int,
        batch_per_dp_rank: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        positions: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens, labels) long, each [B, L] or, with ``positions`` [n], [B, n].

        Sample i of this rank is global sample
        ``(step * dp_size + dp_rank) * batch_per_dp_rank + i`` (``step_indices``); see
        ``rows``."""
        b = self.rows(step_indices(step, batch_per_dp_rank, dp_rank, dp_size), positions)
        return b.tokens, b.labels

    def packed_batch(self, step: int, batch_per_dp_rank: int, dp_rank: int = 0,
                     dp_size: int = 1, positions: torch.Tensor | None = None) -> Batch:
        """``batch``'s windows with document ids; see ``rows(packed=True)``."""
        return self.rows(step_indices(step, batch_per_dp_rank, dp_rank, dp_size), positions,
                         packed=True)

    def doc_lengths(self, samples) -> list[tuple[int, ...]]:
        """The document lengths of each row of global samples ``samples`` [B] (in row order,
        each tuple summing to ``seq_len``; a document the window cuts counts its part
        inside), from the ``.docs`` starts alone; see ``window_doc_lengths``."""
        return self.window_doc_lengths(self.order.lookup(samples)[1])

    def window_doc_lengths(self, windows) -> list[tuple[int, ...]]:
        """``doc_lengths`` of the windows ``windows`` [B] themselves: what every rank reads
        alike, with no token read, to lay the rows out by their documents (needs
        ``documents=True``). The same documents ``rows(packed=True)`` gives ids to."""
        if self.doc_starts is None:
            raise ValueError("document lengths need the document boundaries: build "
                             "MemmapTokens with documents=True")
        out = []
        for w in np.asarray(windows, dtype=np.int64).reshape(-1):
            start = int(w) * self.seq_len
            lo, hi = np.searchsorted(self.doc_starts, [start + 1, start + self.seq_len])
            edges = [0, *(int(x) - start for x in self.doc_starts[lo:hi]), self.seq_len]
            out.append(tuple(b - a for a, b in zip(edges, edges[1:])))
        return out

    def rows(self, samples, positions: torch.Tensor | None = None,
             packed: bool = False) -> Batch:
        """The ``Batch`` [B, L] (or [B, n] with ``positions`` [n] or [B, n]) of global samples
        ``samples`` [B]: each the window ``usp.data.order`` gives it (epochs without
        replacement, fixed by the seed). ``labels[:, j]`` is the token after
        ``tokens[:, j]`` in the file (shifted before sharding, so no label is lost at a
        shard boundary); ``positions`` (global ids, e.g. ``layout.positions()``) selects
        columns, and only those tokens and their successors are read from disk.

        ``packed``: also document ids (the file's document index) and positions inside
        each document (counted from the window start for the document it cuts); a label
        whose target starts the next document is -100. Needs ``documents=True``."""
        return self.windows(self.order.lookup(samples)[1], positions, packed)

    def windows(self, windows, positions: torch.Tensor | None = None,
                packed: bool = False) -> Batch:
        """``rows`` for the windows ``windows`` [B] themselves (window w: tokens
        ``[w * seq_len, (w + 1) * seq_len]``), e.g. the first ones of a validation split."""
        windows = np.asarray(windows, dtype=np.int64)
        if windows.size and (windows.min() < 0 or windows.max() >= self.num_windows):
            raise ValueError(f"{self.bin_path} has windows [0, {self.num_windows}) of "
                             f"{self.seq_len} tokens; asked for [{windows.min()}, "
                             f"{windows.max()}]")
        if packed and self.doc_starts is None:
            raise ValueError("packed rows need the document boundaries: build MemmapTokens "
                             "with documents=True")
        starts = windows * self.seq_len
        b, idx = self._read(starts, positions)
        if not packed:
            return b
        doc = np.searchsorted(self.doc_starts, idx, side="right") - 1  # [B, n]
        nxt = np.searchsorted(self.doc_starts, idx + 1, side="right") - 1  # the label's
        first = np.maximum(self.doc_starts[doc], starts[:, None])  # in this window
        seg = torch.from_numpy(doc.astype(np.int64))
        return Batch(b.tokens, ignore_crossing(b.labels, seg, torch.from_numpy(nxt)), seg,
                     torch.from_numpy((idx - first).astype(np.int64)))

    def _read(self, starts: np.ndarray, positions):
        """(Batch of tokens and labels, absolute offsets [B, n]) of the windows starting at
        ``starts`` [B]; ``positions``: the columns, [n] for every row or [B, n] per row."""
        if positions is None:
            cols = np.arange(self.seq_len)
        else:
            cols = positions.cpu().numpy().astype(np.int64)
            if cols.size and (cols.min() < 0 or cols.max() >= self.seq_len):
                raise ValueError(f"positions must lie in [0, {self.seq_len}), got "
                                 f"[{cols.min()}, {cols.max()}]")
            if cols.ndim == 2 and cols.shape[0] != len(starts):
                raise ValueError(f"positions [B, n] of {cols.shape[0]} rows for "
                                 f"{len(starts)} windows; give one row of positions a window")
        idx = starts[:, None] + (cols if cols.ndim == 2 else cols[None, :])  # [B, n] offsets
        offsets = np.stack([idx, idx + 1])  # [2, B, n]: each token and the one after it
        ids = np.asarray(self.tokens[offsets]).astype(np.int64)  # reads only these entries
        self._check(ids, offsets)
        if self.loss is not None:  # no loss where the target token is masked out
            ids[1][np.asarray(self.loss[offsets[1]]) == 0] = IGNORE_INDEX
        return Batch(torch.from_numpy(ids[0]), torch.from_numpy(ids[1])), idx
