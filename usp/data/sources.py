"""The documents of a corpus folder, streamed in a fixed order, with every bad line counted.

Formats by file name (``.gz`` is decompressed first): ``*.jsonl`` holds one document per
line, the text under ``text_key``; ``*.parquet`` one per row, the column ``text_key``
(pyarrow); any other file is one document (``.txt``, source code, ...). Files are taken in
the order of their path relative to the source folder, so the order never depends on the
file system. A line that is not JSON, lacks the key or holds no string is a ``Problems``
entry (``path:line: why``), never a silent drop; blank lines are not documents.

A document longer than ``PIECE_BYTES`` is handed out in pieces cut after a newline (or a
space), so memory stays bounded whatever one file holds; each piece is tokenized on its
own, which for a subword tokenizer can differ from tokenizing the whole text at the cut.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from .chat import check_messages, content_bytes

PIECE_BYTES = 4 << 20  # longest piece of one document handed to a tokenizer
EXAMPLES = 5  # file:line examples kept per reason
_PARQUET_ROWS = 1024


def list_files(src: Path, pattern: str) -> list[Path]:
    """Regular files under ``src`` matching ``pattern``, sorted by relative POSIX path."""
    files = [p for p in src.glob(pattern) if p.is_file()]
    return sorted(files, key=lambda p: p.relative_to(src).as_posix())


def file_format(path: Path) -> str:
    """``"jsonl"``, ``"parquet"`` or ``"text"`` from the name (a ``.gz`` suffix dropped)."""
    name = path.name[:-3] if path.name.endswith(".gz") else path.name
    if name.endswith(".jsonl"):
        return "jsonl"
    if name.endswith(".parquet"):
        return "parquet"
    return "text"


@dataclass
class Problems:
    """Bad lines by reason: a count and the first ``EXAMPLES`` ``path:line: why`` each."""

    counts: dict = field(default_factory=dict)
    examples: dict = field(default_factory=dict)
    strict: bool = False

    def add(self, reason: str, where: str, detail: str = "", n: int = 1) -> None:
        if self.strict:
            raise ValueError(f"{where}: {reason}{detail} (--strict stops at the first bad "
                             "line or file; drop --strict to count them and go on)")
        self.counts[reason] = self.counts.get(reason, 0) + n
        kept = self.examples.setdefault(reason, [])
        if len(kept) < EXAMPLES:
            kept.append(f"{where}{detail}")

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def lines(self) -> list[str]:
        """One line per reason: ``N lines: why (e.g. a.jsonl:3, b.jsonl:9)``."""
        return [f"{reason}: {n} (e.g. {', '.join(self.examples[reason])})"
                for reason, n in sorted(self.counts.items())]

    def as_dict(self) -> dict:
        return {"counts": dict(sorted(self.counts.items())),
                "examples": {k: v for k, v in sorted(self.examples.items())}}


@dataclass
class Piece:
    """Part of a document: ``text`` (``str``, or ``bytes`` for raw files under the byte
    tokenizer), whether it starts and ends its document, and the document's split."""

    text: str | bytes | list
    first: bool
    last: bool
    val: bool
    where: str = ""  # ``path:line`` of its document

    @property
    def size(self) -> int:
        """Its length in characters (bytes), or a conversation's content bytes."""
        return content_bytes(self.text) if isinstance(self.text, list) else len(self.text)


def in_validation(ident: str, fraction: float) -> bool:
    """Whether the document named ``ident`` (``relative/path:line``) is in the validation
    split: a hash of the name, so the choice depends neither on the order nor on the
    other files."""
    if fraction <= 0:
        return False
    h = int.from_bytes(hashlib.blake2b(ident.encode("utf-8"), digest_size=8).digest(), "little")
    return h < fraction * 2**64


class Corpus:
    """Streams the ``Piece``s of ``files`` (under ``src``) in order.

    ``raw``: hand whole files out as bytes (the byte tokenizer: its ids are the bytes, so
    invalid UTF-8 stays as it is); else text files are decoded as UTF-8 (invalid bytes
    replaced and counted). ``chat``: the records are conversations under ``messages_key``
    (``check_messages``; each one ``Piece`` whose text is the messages); a record holding
    the other kind (or a text file) is refused as a mixed corpus. ``max_bytes`` caps the
    document bytes taken (the document that crosses it is cut; a conversation is kept
    whole). ``bytes_read`` counts the input bytes consumed from disk so far."""

    def __init__(self, src: Path, files: list[Path], text_key: str, val_fraction: float,
                 problems: Problems, raw: bool = False, max_bytes: int | None = None,
                 messages_key: str = "messages", chat: bool = False):
        self.src, self.files, self.text_key = src, files, text_key
        self.messages_key, self.chat = messages_key, chat
        self.key, self.other = (messages_key, text_key) if chat else (text_key, messages_key)
        self.val_fraction, self.problems, self.raw = val_fraction, problems, raw
        self.max_bytes = max_bytes
        self.taken = 0  # document bytes handed out (what max_bytes caps)
        self.files_used = 0
        self.bytes_read = 0  # from disk, compressed where the file is
        self.empty = 0  # documents with no text

    def __iter__(self) -> Iterator[Piece]:
        for path in self.files:
            if self._full():
                return
            self.files_used += 1
            rel = path.relative_to(self.src).as_posix()
            kind = file_format(path)
            if kind == "jsonl":
                docs = ((ident, [text]) for ident, text in self._jsonl(path, rel))
            elif kind == "parquet":
                docs = ((ident, [text]) for ident, text in self._parquet(path, rel))
            elif self.chat:
                raise ValueError(_mixed(f"{rel}:1", "a text file", True))
            else:
                docs = [(f"{rel}:1", self._text(path, rel))]
            try:
                for ident, chunks in docs:
                    yield from self._pieces(ident, chunks)
                    if self._full():
                        break
            except (OSError, EOFError, zlib.error) as e:  # truncated or corrupt, not a bad line
                raise ValueError(f"{rel} cannot be read ({type(e).__name__}: {e}); fix or "
                                 "remove the file, or narrow --glob") from None
            self.bytes_read += path.stat().st_size

    def _full(self) -> bool:
        return self.max_bytes is not None and self.taken >= self.max_bytes

    def _pieces(self, ident: str, chunks) -> Iterator[Piece]:
        """The pieces of one document from its ``chunks`` (str, or bytes when raw), each at
        most ``PIECE_BYTES``, the last one marked; nothing for an empty document. A
        conversation is one piece."""
        val = in_validation(ident, self.val_fraction)
        if self.chat:
            (messages,) = chunks
            self.taken += content_bytes(messages)
            yield Piece(messages, True, True, val, ident)
            return
        pending, first = None, True  # one piece held back, so the last can say so
        for chunk in chunks:
            try:
                data = chunk if isinstance(chunk, bytes) else chunk.encode("utf-8")
            except UnicodeEncodeError as e:  # JSON's "\ud83d": a lone surrogate
                self.problems.add("line skipped, text not encodable as UTF-8", ident,
                                  f" ({e.reason} at {e.start})")
                return
            start = 0
            while start < len(data) and not self._full():
                end = _cut(data, start)
                if self.max_bytes is not None:
                    end = min(end, start + self.max_bytes - self.taken)
                part = data[start:end]
                self.taken += len(part)
                start = end
                if pending is not None:
                    yield Piece(pending, first, False, val)
                    first = False
                pending = part if isinstance(chunk, bytes) else part.decode("utf-8", "ignore")
        if pending is None:
            self.empty += 1
            return
        yield Piece(pending, first, True, val)

    def _text(self, path: Path, rel: str) -> Iterator[str | bytes]:
        """A whole file as one document, read in blocks: bytes when raw, else UTF-8 text
        (invalid bytes replaced, and the file named once)."""
        buf, bad = b"", False
        with _open(path) as f:
            while True:
                block = f.read(PIECE_BYTES)
                buf += block
                while buf and (len(buf) > PIECE_BYTES or not block):  # at most 2 blocks held
                    end = _cut(buf, 0)
                    piece, buf = buf[:end], buf[end:]
                    if self.raw:
                        yield piece
                        continue
                    try:
                        yield piece.decode("utf-8")
                    except UnicodeDecodeError as e:
                        if not bad:
                            self.problems.add("invalid UTF-8 (without --strict: kept, bad bytes replaced by U+FFFD)",
                                              rel, f" at byte {e.start} of a {len(piece)}-byte "
                                              "block")
                            bad = True
                        yield piece.decode("utf-8", errors="replace")
                if not block:
                    return

    def _jsonl(self, path: Path, rel: str):
        key = self.key
        with _open(path) as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                where = f"{rel}:{n}"
                try:
                    obj = json.loads(line)
                except (json.JSONDecodeError, UnicodeDecodeError) as e:
                    why = e.msg if isinstance(e, json.JSONDecodeError) else e.reason
                    self.problems.add("line skipped, not JSON", where, f" ({why})")
                    continue
                if isinstance(obj, dict) and key not in obj and self.other in obj:
                    raise ValueError(_mixed(where, f"the key {self.other!r}", self.chat))
                if not isinstance(obj, dict) or key not in obj:
                    keys = sorted(obj)[:6] if isinstance(obj, dict) else type(obj).__name__
                    flag = "--messages-key" if self.chat else "--text-key"
                    self.problems.add(f"line skipped, no key {key!r} ({flag})", where,
                                      f" (has {keys})")
                    continue
                if self._valid(obj[key], where, "line"):
                    yield where, obj[key]

    def _valid(self, value, where: str, unit: str) -> bool:
        """Whether ``value`` is a text (a string) or, for chat, a conversation; a problem
        entry when it is not."""
        if self.chat:
            why = check_messages(value)
            if why is not None:
                self.problems.add(f"conversation skipped, {why}", where)
            return why is None
        if not isinstance(value, str):
            self.problems.add(f"{unit} skipped, {self.key!r} is not a string", where,
                              f" ({type(value).__name__})")
            return False
        return True

    def _parquet(self, path: Path, rel: str):
        try:
            import pyarrow.parquet as pq
        except ImportError as e:
            raise ValueError(f"{rel} is Parquet, which needs pyarrow; install it with: "
                             "pip install 'usp[data]'") from e
        if path.name.endswith(".gz"):
            raise ValueError(f"{rel}: a gzipped Parquet file; Parquet compresses inside, so "
                             "unzip it (or write it with compression= set)")
        try:
            pf = pq.ParquetFile(path)
        except Exception as e:  # pyarrow's own errors: not a Parquet file, a damaged footer
            raise ValueError(f"{rel} cannot be read as Parquet ({e}); fix or remove the file, "
                             "or narrow --glob") from None
        names, key = pf.schema_arrow.names, self.key
        if key not in names and pf.metadata.num_rows == 0:
            return
        if key not in names and self.other in names:
            raise ValueError(_mixed(f"{rel}:1", f"the column {self.other!r}", self.chat))
        if key not in names:
            flag = "--messages-key" if self.chat else "--text-key"
            self.problems.add(f"rows skipped, no column {key!r} ({flag})",
                              f"{rel}:1", f" (columns {names[:6]}; all "
                              f"{pf.metadata.num_rows} rows)", n=pf.metadata.num_rows)
            return
        row = 0
        for batch in pf.iter_batches(columns=[key], batch_size=_PARQUET_ROWS):
            for value in batch.column(0).to_pylist():
                row += 1
                if self._valid(value, f"{rel}:{row}", "row"):
                    yield f"{rel}:{row}", value


def is_chat(src: Path, files: list[Path], text_key: str, messages_key: str) -> bool:
    """Whether the corpus holds conversations: its first record (in file order) holding
    ``messages_key`` or ``text_key`` holds ``messages_key`` (a text file is a text record)."""
    for path in files:
        kind = file_format(path)
        if kind == "text":
            return False
        if kind == "parquet":
            names = _parquet_names(path)
            if messages_key in names or text_key in names:
                return messages_key in names
            continue
        try:
            with _open(path) as f:
                for line in f:
                    try:
                        obj = json.loads(line)
                    except (json.JSONDecodeError, UnicodeDecodeError):
                        continue
                    if isinstance(obj, dict) and (messages_key in obj or text_key in obj):
                        return messages_key in obj
        except (OSError, EOFError, zlib.error):
            continue  # the reading says why
    return False


def _parquet_names(path: Path) -> list[str]:
    """A Parquet file's columns; none when it cannot be read (the reading says why)."""
    try:
        import pyarrow.parquet as pq

        return pq.read_schema(path).names
    except (ImportError, OSError, ValueError):  # pyarrow's ArrowInvalid is a ValueError
        return []


def _mixed(where: str, what: str, chat: bool) -> str:
    kinds = ("conversations", "text") if chat else ("text", "conversations")
    return (f"{where} holds {what} but the corpus is {kinds[0]} (its first record says so); "
            f"usp-prepare takes one kind a run: prepare the {kinds[1]} with their own --glob "
            "or --out and mix the two with data.blend")


def _open(path: Path):
    return gzip.open(path, "rb") if path.name.endswith(".gz") else open(path, "rb")


def _cut(data: bytes, start: int) -> int:
    """End of the piece that begins at ``start``: after the last newline (else space) within
    ``PIECE_BYTES``, else at a UTF-8 character boundary."""
    end = start + PIECE_BYTES
    if end >= len(data):
        return len(data)
    for sep in (b"\n", b" "):
        at = data.rfind(sep, start, end)
        if at > start:
            return at + 1
    while end > start + 1 and (data[end] & 0xC0) == 0x80:  # not inside a UTF-8 character
        end -= 1
    return end
