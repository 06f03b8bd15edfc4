"""Turn text files into a memmap token file for ``usp.data.MemmapTokens``, offline.

Byte-level tokenizer: every byte is its own token (0..255) and each file ends with
EOS = 256, so vocab_size = 257 and the tokens are stored as uint16. Output: ``{out}.bin``
(raw tokens) and ``{out}.json`` (metadata), written atomically (``*.tmp`` then rename).
Files are taken in sorted order of their path relative to ``--src`` (deterministic), and
``--max-bytes`` caps the input bytes (the last file is cut to fit).

    python tools/prepare_data.py \\
        --src "$(python -c 'import sysconfig;print(sysconfig.get_paths()["stdlib"])')" \\
        --glob '**/*.py' --out data/pystdlib --max-bytes 20000000
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from usp.data.memmap import TokenWriter  # noqa: E402

EOS = 256
VOCAB_SIZE = 257


def list_files(src: Path, pattern: str) -> list[Path]:
    """Regular files under ``src`` matching ``pattern``, sorted by relative POSIX path."""
    files = [p for p in src.glob(pattern) if p.is_file()]
    return sorted(files, key=lambda p: p.relative_to(src).as_posix())


def prepare(src: str | Path, pattern: str, out: str | Path, max_bytes: int | None = None) -> dict:
    """Tokenize the files and write ``{out}.bin`` + ``{out}.json``; returns the metadata."""
    src = Path(src)
    if not src.is_dir():
        raise SystemExit(f"--src {src} is not a directory")
    files = list_files(src, pattern)
    if not files:
        raise SystemExit(f"no files under {src} match --glob {pattern!r}")
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
            # bytes -> uint16 ids, then EOS: [len(data)] -> [len(data) + 1]
            writer.write(np.append(np.frombuffer(data, dtype=np.uint8).astype(np.uint16), EOS))
        source.update(num_files=used, num_bytes=total)
        return writer.close(eos_id=EOS)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--src", required=True, help="directory to read text files from")
    ap.add_argument("--glob", default="**/*.txt", help="pattern relative to --src")
    ap.add_argument("--out", required=True, help="output prefix: writes OUT.bin and OUT.json")
    ap.add_argument("--max-bytes", type=int, default=None, help="cap on input bytes")
    args = ap.parse_args(argv)
    meta = prepare(args.src, args.glob, args.out, args.max_bytes)
    print(
        f"wrote {args.out}.bin: {meta['num_tokens']} tokens from "
        f"{meta['source']['num_files']} files ({meta['dtype']}, vocab {meta['vocab_size']})"
    )


if __name__ == "__main__":
    main()
