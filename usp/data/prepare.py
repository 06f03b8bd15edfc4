"""Turn text files into a memmap token file for ``usp.data.MemmapTokens``, offline.

Byte-level tokenizer: every byte is its own token (0..255) and each file ends with
``EOS`` = 256, so ``VOCAB_SIZE`` = 257 and the tokens are stored as uint16. Output:
``{out}.bin`` (raw tokens), ``{out}.json`` (metadata) and ``{out}.docs`` (where each
file's document starts, for ``data.packing=documents``), written atomically by
``TokenWriter``. Files are taken in sorted order of their path relative to ``src``
(deterministic), and ``max_bytes`` caps the input bytes (the last file is cut to fit).
The command line::

    python -m usp.data.prepare --src DIR --glob '**/*.txt' --out data/corpus [--max-bytes N]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from .memmap import TokenWriter

EOS = 256
VOCAB_SIZE = 257


def list_files(src: Path, pattern: str) -> list[Path]:
    """Regular files under ``src`` matching ``pattern``, sorted by relative POSIX path."""
    files = [p for p in src.glob(pattern) if p.is_file()]
    return sorted(files, key=lambda p: p.relative_to(src).as_posix())


def prepare(src: str | Path, pattern: str, out: str | Path, max_bytes: int | None = None) -> dict:
    """Tokenize the files and write ``{out}.bin`` + ``{out}.json``; returns the metadata.

    Raises ``ValueError`` before writing anything when ``src`` is not a directory, no file
    matches ``pattern`` or ``max_bytes`` is negative.
    """
    src = Path(src)
    if not src.is_dir():
        raise ValueError(f"src {str(src)!r} is not a directory; pass the folder holding the "
                         "text files (--src)")
    if max_bytes is not None and max_bytes < 0:
        raise ValueError(f"max_bytes={max_bytes} is negative; pass a byte count >= 0 or None "
                         "for no cap (--max-bytes)")
    files = list_files(src, pattern)
    if not files:
        raise ValueError(f"no files under {src} match the pattern {pattern!r}; pick a pattern "
                         "relative to src such as '**/*.txt' (--glob)")
    used, total = 0, 0
    source = {"src": str(src), "glob": pattern, "max_bytes": max_bytes}
    with TokenWriter(out, VOCAB_SIZE, "bytes+eos", source) as writer:
        for path in files:
            if max_bytes is not None and total >= max_bytes:
                break
            data = path.read_bytes()
            if max_bytes is not None:
                data = data[: max_bytes - total]
            total += len(data)
            used += 1
            # one document per file: bytes -> uint16 ids, then EOS: [len(data)] -> [len(data) + 1]
            writer.write_document(
                np.append(np.frombuffer(data, dtype=np.uint8).astype(np.uint16), EOS))
        source.update(num_files=used, num_bytes=total)
        return writer.close(eos_id=EOS)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--src", required=True, help="directory to read text files from")
    ap.add_argument("--glob", default="**/*.txt", help="pattern relative to --src")
    ap.add_argument("--out", required=True, help="output prefix: writes OUT.bin and OUT.json")
    ap.add_argument("--max-bytes", type=int, default=None, help="cap on input bytes")
    args = ap.parse_args(argv)
    try:
        meta = prepare(args.src, args.glob, args.out, args.max_bytes)
    except ValueError as e:
        ap.error(str(e))
    print(
        f"wrote {args.out}.bin: {meta['num_tokens']} tokens from "
        f"{meta['source']['num_files']} files = {meta['num_documents']} documents "
        f"({meta['dtype']}, vocab {meta['vocab_size']})"
    )


if __name__ == "__main__":
    main()
