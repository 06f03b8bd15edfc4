"""Memory-mapped token files: ``{prefix}.bin`` (raw uint16/uint32) + ``{prefix}.json`` (metadata).

Metadata keys: ``dtype`` ("uint16" | "uint32"), ``num_tokens``, ``vocab_size``,
``tokenizer``, ``source``, and optionally ``max_token``, ``eos_id`` and ``num_documents``.
With ``num_documents``, ``{prefix}.docs`` holds the document start offsets (raw int64,
increasing, the first 0). Files are written by ``TokenWriter`` (used by
``python -m usp.data.prepare``) atomically: all go to ``*.tmp`` first and are renamed when
complete, the ``.json`` last.

Training windows are drawn at random (with replacement) from the whole file; each sample
reads ``seq_len + 1`` tokens so the label of the last position is the token after the
window. With ``positions`` a rank reads only the tokens it owns (and their successors).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import torch

from .indexing import sample_indices
from .packing import Batch, ignore_crossing

DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
REQUIRED_KEYS = ("dtype", "num_tokens", "vocab_size", "tokenizer", "source")
DOC_DTYPE = np.dtype("<i8")  # document start offsets in {prefix}.docs
_PREPARE = "python -m usp.data.prepare --src DIR --glob '**/*.txt' --out {prefix}"
_SCAN_CHUNK = 1 << 24  # tokens per chunk when verifying ids


def data_paths(path: str | os.PathLike) -> tuple[Path, Path]:
    """``data/x``, ``data/x.bin`` or ``data/x.json`` -> (``data/x.bin``, ``data/x.json``)."""
    p = Path(path)
    prefix = p.with_suffix("") if p.suffix in (".bin", ".json", ".docs") else p
    return prefix.with_name(prefix.name + ".bin"), prefix.with_name(prefix.name + ".json")


def docs_path(path: str | os.PathLike) -> Path:
    """The document start offsets next to ``path``'s ``.bin``: ``data/x.docs``."""
    bin_path = data_paths(path)[0]
    return bin_path.with_suffix(".docs")


def tokenizer_dir(path: str | os.PathLike) -> Path:
    """The tokenizer files next to ``path``'s ``.bin`` (``usp-prepare`` copies a Hugging Face
    tokenizer there; byte-tokenized data has none): ``data/x.tokenizer``."""
    bin_path = data_paths(path)[0]
    return bin_path.with_suffix(".tokenizer")


def _tmp(path: Path) -> Path:
    return path.with_name(path.name + ".tmp")


class TokenWriter:
    """Stream token arrays into ``{prefix}.bin`` + ``{prefix}.json``; atomic on ``close()``.

    Use as a context manager; on an exception the temporary files are removed and nothing
    at ``prefix`` changes. dtype is uint16 when ``vocab_size <= 65536``, else uint32.
    ``write_document`` also records where a document starts (``{prefix}.docs``); plain
    ``write`` continues the current document; ``write_documents`` appends a block holding
    several. Memory does not grow with the file: tokens and document starts go to disk as
    they come.
    """

    def __init__(self, prefix: str | os.PathLike, vocab_size: int, tokenizer: str, source):
        self.bin_path, self.json_path = data_paths(prefix)
        self.bin_path.parent.mkdir(parents=True, exist_ok=True)
        self.dtype = "uint16" if vocab_size <= 1 << 16 else "uint32"
        self.meta = {"vocab_size": vocab_size, "tokenizer": tokenizer, "source": source}
        self.num_tokens, self.max_token, self.num_documents = 0, -1, 0
        self._tmp = _tmp(self.bin_path)
        self._f = open(self._tmp, "wb")
        self._docs = open(_tmp(docs_path(self.bin_path)), "wb")

    def write(self, tokens) -> None:
        """Append a 1-D array of token ids (each < vocab_size)."""
        arr = np.asarray(tokens)
        if arr.size == 0:
            return
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi >= self.meta["vocab_size"]:
            raise ValueError(
                f"token ids must lie in [0, {self.meta['vocab_size']}), got [{lo}, {hi}]"
            )
        self._f.write(arr.astype(DTYPES[self.dtype]).tobytes())
        self.num_tokens += arr.size
        self.max_token = max(self.max_token, hi)

    def write_document(self, tokens) -> None:
        """Append a 1-D array of token ids that starts a new document."""
        self.write_documents(tokens, [0])

    def write_documents(self, tokens, starts) -> None:
        """Append ``tokens`` [n], in which documents start at the offsets ``starts``
        (increasing; tokens before the first start continue the current document; a start
        at ``n`` or a repeated one, an empty document, is dropped)."""
        arr = np.asarray(tokens)
        if arr.size == 0:
            return
        at = np.unique(np.asarray(starts, dtype=np.int64))
        at = at[(at >= 0) & (at < arr.size)] + self.num_tokens  # offsets in the file
        if at.size and not self.num_documents and self.num_tokens and at[0] > 0:
            at = np.concatenate([[0], at])  # tokens written before: the first document
        self.write(arr)
        self._docs.write(at.astype(DOC_DTYPE).tobytes())
        self.num_documents += int(at.size)

    def close(self, **extra) -> dict:
        """Finish: fsync, write metadata (plus ``extra`` keys), rename into place."""
        meta = self.finish(**extra)
        self.publish()
        return meta

    def finish(self, **extra) -> dict:
        """Complete every file under its ``.tmp`` name (the ``.bin`` fsynced, the metadata
        with ``extra`` keys) without touching ``prefix``; ``publish`` renames them. Lets a
        caller complete several writers before any of them replaces its files."""
        for f in (self._f, self._docs):
            f.flush()
            os.fsync(f.fileno())
            f.close()
        meta = {"dtype": self.dtype, "num_tokens": self.num_tokens, **self.meta}
        meta.update(max_token=self.max_token, **extra)
        if self.num_documents:
            meta["num_documents"] = self.num_documents
        _tmp(self.json_path).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
        return meta

    def publish(self) -> None:
        """Rename the finished files into place, the ``.json`` last."""
        docs = docs_path(self.bin_path)
        os.replace(self._tmp, self.bin_path)
        if self.num_documents:
            os.replace(_tmp(docs), docs)
        else:
            _tmp(docs).unlink(missing_ok=True)
            docs.unlink(missing_ok=True)  # an older file's boundaries would not match
        os.replace(_tmp(self.json_path), self.json_path)  # last: a .json means complete files

    def abort(self) -> None:
        """Remove every temporary file; nothing at ``prefix`` changes."""
        self._f.close()
        self._docs.close()
        for path in (self._tmp, _tmp(docs_path(self.bin_path)), _tmp(self.json_path)):
            path.unlink(missing_ok=True)

    def __enter__(self) -> "TokenWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()
        elif not self._f.closed:
            self.close()


def _read_meta(json_path: Path, prefix: Path) -> dict:
    if not json_path.is_file():
        raise FileNotFoundError(
            f"token metadata {json_path} not found (the .bin needs its .json); recreate "
            f"both with: {_PREPARE.format(prefix=prefix)}"
        )
    try:
        meta = json.loads(json_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"token metadata {json_path} is not valid JSON ({e}); recreate it "
                         f"with: {_PREPARE.format(prefix=prefix)}") from e
    missing = [k for k in REQUIRED_KEYS if not isinstance(meta, dict) or k not in meta]
    if missing:
        raise ValueError(f"token metadata {json_path} lacks keys {missing} (needs "
                         f"{list(REQUIRED_KEYS)}); recreate it with: "
                         f"{_PREPARE.format(prefix=prefix)}")
    if meta["dtype"] not in DTYPES:
        raise ValueError(f"token metadata {json_path}: dtype {meta['dtype']!r} is not one of "
                         f"{sorted(DTYPES)}")
    return meta


class MemmapTokens:
    """Random ``seq_len`` windows from a token file, labels shifted on the global sequence.

    ``path`` is the prefix (``data/x`` for ``data/x.bin`` + ``data/x.json``) or either file.
    ``verify`` scans the whole file once for ids >= vocab_size (chunked; pass False for
    huge corpora, every batch is still checked). Raises FileNotFoundError for a missing
    file and ValueError for bad metadata, a size mismatch, a file shorter than
    ``seq_len + 1`` tokens, or out-of-range ids; every message names the file and numbers.
    ``documents``: load the document boundaries for ``packed_batch`` (ValueError when the
    file records none, or they do not fit the tokens).
    """

    def __init__(self, path: str | os.PathLike, seq_len: int, seed: int = 0, verify: bool = True,
                 documents: bool = False):
        self.bin_path, self.json_path = data_paths(path)
        prefix = self.bin_path.with_suffix("")
        if not self.bin_path.is_file():
            raise FileNotFoundError(
                f"token file {self.bin_path} not found; create it with: "
                f"{_PREPARE.format(prefix=prefix)}"
            )
        self.meta = _read_meta(self.json_path, prefix)
        self.seq_len, self.seed = seq_len, seed
        self.vocab_size = int(self.meta["vocab_size"])
        self.num_tokens = int(self.meta["num_tokens"])
        dtype = np.dtype(DTYPES[self.meta["dtype"]])
        expected, actual = self.num_tokens * dtype.itemsize, self.bin_path.stat().st_size
        if actual != expected:
            raise ValueError(
                f"{self.bin_path} has {actual} bytes but {self.json_path} says num_tokens="
                f"{self.num_tokens} x {dtype.itemsize} bytes ({self.meta['dtype']}) = {expected}: "
                f"truncated or corrupt; recreate with: {_PREPARE.format(prefix=prefix)}"
            )
        if self.num_tokens < seq_len + 1:
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

    def _load_documents(self, prefix: Path) -> np.ndarray:
        """The document start offsets [num_documents] int64 (read lazily from ``.docs``)."""
        docs, n = docs_path(self.bin_path), self.meta.get("num_documents")
        fix = f"re-run usp.data.prepare, which records them: {_PREPARE.format(prefix=prefix)}"
        if n is None or not docs.is_file():
            raise ValueError(f"{self.json_path} records no document boundaries (no "
                             f"num_documents / {docs.name}), so data.packing=documents cannot "
                             f"tell documents apart; {fix}; or use data.packing=none")
        if docs.stat().st_size != int(n) * DOC_DTYPE.itemsize or int(n) < 1:
            raise ValueError(f"{docs} has {docs.stat().st_size} bytes but {self.json_path} says "
                             f"num_documents={n} x {DOC_DTYPE.itemsize}: truncated or stale; {fix}")
        starts = np.memmap(docs, dtype=DOC_DTYPE, mode="r", shape=(int(n),))
        if starts[0] != 0 or starts[-1] >= self.num_tokens or (np.diff(starts) <= 0).any():
            raise ValueError(f"{docs}: document starts must increase from 0 and stay below "
                             f"num_tokens={self.num_tokens}; {fix}")
        return starts

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
        """First token of global sample ``index``: uniform in [0, num_tokens - seq_len - 1]."""
        rng = np.random.default_rng([self.seed, index])
        return int(rng.integers(0, self.num_tokens - self.seq_len))

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
        ``(step * dp_size + dp_rank) * batch_per_dp_rank + i``, whose window start depends
        only on (seed, that index). ``labels[:, j]`` is the token after ``tokens[:, j]`` in the
        file (shifted before sharding, so no label is lost at a shard boundary).
        ``positions`` (global ids, e.g. ``layout.positions()``) selects columns; only
        those tokens and their successors are read from disk.
        """
        b = self._read(step, batch_per_dp_rank, dp_rank, dp_size, positions)[0]
        return b.tokens, b.labels

    def packed_batch(self, step: int, batch_per_dp_rank: int, dp_rank: int = 0,
                     dp_size: int = 1, positions: torch.Tensor | None = None) -> Batch:
        """``batch``'s windows with document ids (the file's document index) and positions
        inside each document (counted from the window start for the document it cuts); a
        label whose target starts the next document is -100. Needs ``documents=True``."""
        if self.doc_starts is None:
            raise ValueError("packed_batch needs the document boundaries: build MemmapTokens "
                             "with documents=True")
        b, idx, window = self._read(step, batch_per_dp_rank, dp_rank, dp_size, positions)
        doc = np.searchsorted(self.doc_starts, idx, side="right") - 1  # [B, n]
        nxt = np.searchsorted(self.doc_starts, idx + 1, side="right") - 1  # the label's
        first = np.maximum(self.doc_starts[doc], window[:, None])  # in this window
        seg = torch.from_numpy(doc.astype(np.int64))
        return Batch(b.tokens, ignore_crossing(b.labels, seg, torch.from_numpy(nxt)), seg,
                     torch.from_numpy((idx - first).astype(np.int64)))

    def _read(self, step, batch_per_dp_rank, dp_rank, dp_size, positions):
        """(Batch of tokens and labels, absolute offsets [B, n], window starts [B])."""
        if positions is None:
            cols = np.arange(self.seq_len)
        else:
            cols = positions.cpu().numpy().astype(np.int64)
            if cols.size and (cols.min() < 0 or cols.max() >= self.seq_len):
                raise ValueError(f"positions must lie in [0, {self.seq_len}), got "
                                 f"[{cols.min()}, {cols.max()}]")
        ids = sample_indices(step, batch_per_dp_rank, dp_rank, dp_size)
        starts = np.array([self.window_start(i) for i in ids])
        idx = starts[:, None] + cols[None, :]  # [B, n] absolute offsets into the file
        offsets = np.stack([idx, idx + 1])  # [2, B, n]: each token and the one after it
        ids = np.asarray(self.tokens[offsets]).astype(np.int64)  # reads only these entries
        self._check(ids, offsets)
        return Batch(torch.from_numpy(ids[0]), torch.from_numpy(ids[1])), idx, starts
