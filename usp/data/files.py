"""Token files on disk: where a prefix's files live, ``TokenWriter`` (which writes them
atomically) and their metadata. No torch: ``usp-prepare`` and its workers import only this.

``{prefix}.bin`` holds the raw ids (uint16, or uint32 for a vocabulary over 65536),
``{prefix}.json`` the metadata: ``dtype``, ``num_tokens``, ``vocab_size``, ``tokenizer``,
``source``, and optionally ``max_token``, ``eos_id``, ``num_documents`` and what
``usp-prepare`` adds (``split``, ``val``, ``problems``, ``tokenizer_dir``; for conversations
``loss_kind: "assistant"``, ``chat``, ``chat_template``, ``chat_template_hash``). With
``num_documents``, ``{prefix}.docs`` holds the document start offsets (raw int64,
increasing, the first 0). With ``loss_mask`` (and ``loss_tokens``, how many are 1),
``{prefix}.loss`` holds one byte per token: 1 where the token counts as a target of the
loss, 0 where no loss is taken on predicting it (``usp.data.memmap``). All files go to
``*.tmp`` first and are renamed when complete, the ``.json`` last.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
REQUIRED_KEYS = ("dtype", "num_tokens", "vocab_size", "tokenizer", "source")
DOC_DTYPE = np.dtype("<i8")  # document start offsets in {prefix}.docs
PREPARE_HINT = "usp-prepare --src DIR --glob '**/*.jsonl' --out {prefix}"  # the fix in messages


def data_paths(path: str | os.PathLike) -> tuple[Path, Path]:
    """``data/x``, ``data/x.bin`` or ``data/x.json`` -> (``data/x.bin``, ``data/x.json``)."""
    p = Path(path)
    prefix = p.with_suffix("") if p.suffix in (".bin", ".json", ".docs") else p
    return prefix.with_name(prefix.name + ".bin"), prefix.with_name(prefix.name + ".json")


def docs_path(path: str | os.PathLike) -> Path:
    """The document start offsets next to ``path``'s ``.bin``: ``data/x.docs``."""
    bin_path = data_paths(path)[0]
    return bin_path.with_suffix(".docs")


def loss_path(path: str | os.PathLike) -> Path:
    """The loss mask next to ``path``'s ``.bin``: ``data/x.loss`` (one byte per token)."""
    return data_paths(path)[0].with_suffix(".loss")


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
    they come. ``loss_mask``: every write also gives ``loss``, one 0/1 a token (1: the token
    is a target of the loss), written to ``{prefix}.loss``.
    """

    def __init__(self, prefix: str | os.PathLike, vocab_size: int, tokenizer: str, source,
                 loss_mask: bool = False):
        self.bin_path, self.json_path = data_paths(prefix)
        self.bin_path.parent.mkdir(parents=True, exist_ok=True)
        self.dtype = "uint16" if vocab_size <= 1 << 16 else "uint32"
        self.meta = {"vocab_size": vocab_size, "tokenizer": tokenizer, "source": source}
        self.num_tokens, self.max_token, self.num_documents = 0, -1, 0
        self.loss_tokens = 0
        self._tmp = _tmp(self.bin_path)
        self._f = open(self._tmp, "wb")
        self._docs = open(_tmp(docs_path(self.bin_path)), "wb")
        self._loss = open(_tmp(loss_path(self.bin_path)), "wb") if loss_mask else None

    def write(self, tokens, loss=None) -> None:
        """Append a 1-D array of token ids (each < vocab_size), with ``loss`` (0/1 each, as
        many) when the writer keeps a loss mask."""
        arr = np.asarray(tokens)
        if (loss is None) != (self._loss is None):
            raise ValueError("a loss mask is given with every write of a writer made with "
                             "loss_mask=True, and only then")
        if arr.size == 0:
            return
        if loss is not None:
            mask = np.asarray(loss, dtype=np.uint8)
            if mask.shape != arr.shape or mask.max() > 1:
                raise ValueError(f"loss {mask.shape} must be 0/1, one per token {arr.shape}")
            self._loss.write(mask.tobytes())
            self.loss_tokens += int(mask.sum())
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi >= self.meta["vocab_size"]:
            raise ValueError(
                f"token ids must lie in [0, {self.meta['vocab_size']}), got [{lo}, {hi}]"
            )
        self._f.write(arr.astype(DTYPES[self.dtype]).tobytes())
        self.num_tokens += arr.size
        self.max_token = max(self.max_token, hi)

    def write_document(self, tokens, loss=None) -> None:
        """Append a 1-D array of token ids that starts a new document."""
        self.write_documents(tokens, [0], loss)

    def write_documents(self, tokens, starts, loss=None) -> None:
        """Append ``tokens`` [n] (and their ``loss``, see ``write``), in which documents start
        at the offsets ``starts`` (increasing; tokens before the first start continue the
        current document; a start at ``n`` or a repeated one, an empty document, is
        dropped)."""
        arr = np.asarray(tokens)
        if arr.size == 0:
            return
        at = np.unique(np.asarray(starts, dtype=np.int64))
        at = at[(at >= 0) & (at < arr.size)] + self.num_tokens  # offsets in the file
        if at.size and not self.num_documents and self.num_tokens and at[0] > 0:
            at = np.concatenate([[0], at])  # tokens written before: the first document
        self.write(arr, loss)
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
        for f in (self._f, self._docs, self._loss):
            if f is not None:
                f.flush()
                os.fsync(f.fileno())
                f.close()
        meta = {"dtype": self.dtype, "num_tokens": self.num_tokens, **self.meta}
        meta.update(max_token=self.max_token, **extra)
        if self.num_documents:
            meta["num_documents"] = self.num_documents
        if self._loss is not None:
            meta.update(loss_mask=True, loss_tokens=self.loss_tokens)
        _tmp(self.json_path).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
        return meta

    def publish(self) -> None:
        """Rename the finished files into place, the ``.json`` last."""
        docs, loss = docs_path(self.bin_path), loss_path(self.bin_path)
        os.replace(self._tmp, self.bin_path)
        if self._loss is not None:
            os.replace(_tmp(loss), loss)
        else:
            loss.unlink(missing_ok=True)  # an older file's mask would not match
        if self.num_documents:
            os.replace(_tmp(docs), docs)
        else:
            _tmp(docs).unlink(missing_ok=True)
            docs.unlink(missing_ok=True)  # an older file's boundaries would not match
        os.replace(_tmp(self.json_path), self.json_path)  # last: a .json means complete files

    def abort(self) -> None:
        """Remove every temporary file; nothing at ``prefix`` changes."""
        for f in (self._f, self._docs, self._loss):
            if f is not None:
                f.close()
        for path in (self._tmp, _tmp(docs_path(self.bin_path)), _tmp(loss_path(self.bin_path)),
                     _tmp(self.json_path)):
            path.unlink(missing_ok=True)

    def __enter__(self) -> "TokenWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()
        elif not self._f.closed:
            self.close()


def read_meta(json_path: Path, prefix: Path) -> dict:
    """The metadata ``json_path`` holds, checked for the keys and dtype every reader needs;
    FileNotFoundError / ValueError name the file and the command that remakes it."""
    if not json_path.is_file():
        raise FileNotFoundError(
            f"token metadata {json_path} not found (the .bin needs its .json); recreate "
            f"both with: {PREPARE_HINT.format(prefix=prefix)}"
        )
    try:
        meta = json.loads(json_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"token metadata {json_path} is not valid JSON ({e}); recreate it "
                         f"with: {PREPARE_HINT.format(prefix=prefix)}") from e
    missing = [k for k in REQUIRED_KEYS if not isinstance(meta, dict) or k not in meta]
    if missing:
        raise ValueError(f"token metadata {json_path} lacks keys {missing} (needs "
                         f"{list(REQUIRED_KEYS)}); recreate it with: "
                         f"{PREPARE_HINT.format(prefix=prefix)}")
    if meta["dtype"] not in DTYPES:
        raise ValueError(f"token metadata {json_path}: dtype {meta['dtype']!r} is not one of "
                         f"{sorted(DTYPES)}")
    return meta
