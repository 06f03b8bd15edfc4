"""Passkey documents to blend into a training corpus: each document is the protocol's
filler with the needle "The pass key is K. Remember it. K is the pass key." at a random
depth, then the question and the key, so a model learns to retrieve what ``usp-eval``
scores (``usp.scoring.passkey``: the same sentences).

    python -m tools.passkey_corpus --out data/passkey_src --docs 4000 --chars 240 --digits 3
    usp-prepare --src data/passkey_src --glob '*.jsonl' --out data/passkey --workers 1
    usp-train data=memmap model.vocab_size=auto \
        'data.blend=[{path: data/passkey, weight: 0.8}, {path: data/text, weight: 0.2}]' ...

Documents are seeded (``--seed``); their keys are drawn from another stream than
``usp-eval``'s, so training never sees an evaluation case verbatim.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from usp.scoring.passkey import FILLER, NEEDLE, QUESTION


def passkey_document(rng, chars: int, digits: int) -> str:
    """One document of about ``chars`` characters (at least the needle and question): the
    filler's sentences repeated, the needle at a random sentence boundary, the question
    and the key last."""
    key = str(rng.integers(1, 10)) + "".join(str(d) for d in rng.integers(0, 10, digits - 1))
    needle = NEEDLE.format(key=key)
    tail = f"{QUESTION} {key}"
    sentences = [s.strip() + ". " for s in FILLER.split(".") if s.strip()]
    room = max(0, chars - len(needle) - len(tail))
    hay, i = [], 0
    while sum(len(s) for s in hay) < room:
        hay.append(sentences[i % len(sentences)])
        i += 1
    at = int(rng.integers(0, len(hay) + 1))
    return ("".join(hay[:at]).strip() + needle + "".join(hay[at:])).strip() + tail


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="passkey_corpus", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="folder to write passkey.jsonl into")
    ap.add_argument("--docs", type=int, default=4000)
    ap.add_argument("--chars", type=int, default=240, help="about this many characters each")
    ap.add_argument("--digits", type=int, default=5)
    ap.add_argument("--seed", type=int, default=12345)
    args = ap.parse_args(argv)
    if args.docs < 1 or args.digits < 1 or args.chars < 1:
        ap.error("--docs, --digits and --chars must be >= 1")
    rng = np.random.default_rng(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "passkey.jsonl", "w") as f:
        for _ in range(args.docs):
            f.write(json.dumps({"text": passkey_document(rng, args.chars, args.digits)}) + "\n")
    print(f"passkey_corpus: {args.docs} documents of ~{args.chars} characters, "
          f"{args.digits}-digit keys -> {out / 'passkey.jsonl'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
