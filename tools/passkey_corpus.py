"""Passkey documents to blend into a training corpus: each document is the protocol's
filler with the needle "The pass key is K. Remember it. K is the pass key." at a random
depth, then the question and the key, so a model learns to retrieve what ``usp-eval``
scores (``usp.eval.passkey``: the same sentences).

    python -m tools.passkey_corpus --out data/passkey_src --docs 4000 --chars 240 --digits 3
    usp-prepare --src data/passkey_src --glob '*.jsonl' --out data/passkey --workers 1
    usp-train data=memmap model.vocab_size=auto \
        'data.blend=[{path: data/passkey, weight: 0.8}, {path: data/text, weight: 0.2}]' ...

``--exact``: every document is exactly ``--chars`` characters, built as ``usp-eval`` builds
a case of that length (``usp.eval.passkey.make_case`` with byte tokens and the filler
haystack) at a uniformly random depth: the needle at any character of the filler, the key
last. Prepared with ``usp-prepare --tokenizer bytes --no-eos`` and trained at
``data.seq_len`` = ``--chars``, each training window is one whole document.

Documents are seeded (``--seed``); their keys are drawn from another stream than
``usp-eval``'s (short keys still repeat: there are only 9 x 10^(digits-1) of them).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from usp.eval.passkey import (FILLER, NEEDLE, QUESTION, ByteTokenizer, filler_haystack,
                                 make_case)


def _key(rng, digits: int) -> str:
    return str(rng.integers(1, 10)) + "".join(str(d) for d in rng.integers(0, 10, digits - 1))


def passkey_document(rng, chars: int, digits: int) -> str:
    """One document of about ``chars`` characters (at least the needle and question): the
    filler's sentences repeated, the needle at a random sentence boundary, the question
    and the key last."""
    key = _key(rng, digits)
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


def exact_document(rng, chars: int, digits: int) -> str:
    """One document of exactly ``chars`` characters: ``usp-eval``'s passkey case of that
    length (byte tokens, filler haystack) at a uniformly random depth. ValueError when
    ``chars`` cannot hold the needle, the question and the key."""
    need = len(NEEDLE.format(key="0" * digits)) + len(QUESTION) + 1 + digits
    if chars < need:
        raise ValueError(f"a document of {digits}-digit keys needs at least {need} characters "
                         f"(needle, question and key), not {chars}; raise --chars")
    tok = ByteTokenizer()
    case = make_case(tok, chars, float(rng.random()), _key(rng, digits),
                     filler_haystack(tok), tok.vocab_size, rng)
    return tok.decode(case.tokens)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="passkey_corpus", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="folder to write passkey.jsonl into")
    ap.add_argument("--docs", type=int, default=4000)
    ap.add_argument("--chars", type=int, default=240, help="about this many characters each")
    ap.add_argument("--exact", action="store_true",
                    help="exactly --chars characters each, as usp-eval's case of that length")
    ap.add_argument("--digits", type=int, default=5)
    ap.add_argument("--seed", type=int, default=12345)
    args = ap.parse_args(argv)
    if args.docs < 1 or args.digits < 1 or args.chars < 1:
        ap.error("--docs, --digits and --chars must be >= 1")
    make = exact_document if args.exact else passkey_document
    rng = np.random.default_rng(args.seed)
    try:
        make(np.random.default_rng(args.seed), args.chars, args.digits)
    except ValueError as e:
        ap.error(str(e))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "passkey.jsonl", "w") as f:
        for _ in range(args.docs):
            f.write(json.dumps({"text": make(rng, args.chars, args.digits)}) + "\n")
    size = "exactly " if args.exact else "~"
    print(f"passkey_corpus: {args.docs} documents of {size}{args.chars} characters, "
          f"{args.digits}-digit keys -> {out / 'passkey.jsonl'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
