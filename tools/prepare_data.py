"""Turn text files into a memmap token file for ``usp.data.MemmapTokens``, offline.

Byte-level tokens (vocab 257: bytes 0..255 and EOS 256 after each file), written as
``{out}.bin`` + ``{out}.json`` + ``{out}.docs`` (each file a document); the rules are in
``usp/data/prepare.py``.

    python tools/prepare_data.py \\
        --src "$(python -c 'import sysconfig;print(sysconfig.get_paths()["stdlib"])')" \\
        --glob '**/*.py' --out data/pystdlib --max-bytes 20000000
"""

from __future__ import annotations

import argparse

from usp.data.prepare import prepare


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
