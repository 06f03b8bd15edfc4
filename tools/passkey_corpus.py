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

``--tokens PREFIX`` (with ``--exact``): write the documents as token files directly, byte
tokens without EOS, one document a case, as ``usp-prepare --no-eos`` would (``PREFIX`` and,
``--val-fraction`` of them, ``PREFIX.val``). ``--mask-first-key`` adds a loss mask
(``PREFIX.loss``, ``usp.data.files``) that takes no loss on predicting the needle's first
key: a random digit nothing before it tells, whose irreducible loss only adds noise to the
digits' embeddings; the key's repetition in the needle and the answer still count.

    python -m tools.passkey_corpus --tokens data/pk128 --docs 4000 --chars 128 --exact \
        --digits 1 --seed 1 --mask-first-key

Documents are seeded (``--seed``); their keys are drawn from another stream than
``usp-eval``'s (short keys still repeat: there are only 9 x 10^(digits-1) of them).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from usp.data.files import TokenWriter
from usp.data.tokenize import BYTE_VOCAB
from usp.eval.passkey import (FILLER, NEEDLE, QUESTION, ByteTokenizer, filler_haystack,
                                 make_case)

VAL_SUFFIX = ".val"  # the validation split's prefix, as usp-prepare names it
BYTES = "bytes+eos"  # the byte tokenizer as usp-prepare records it


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


def first_key_mask(text: str) -> np.ndarray:
    """0/1 a byte of ``text``: 0 on the needle's first key (the digits after its first "The
    pass key is "), 1 elsewhere."""
    head = NEEDLE.split("{key}")[0]
    at = text.index(head) + len(head)
    end = text.index(".", at)
    mask = np.ones(len(text.encode()), dtype=np.uint8)
    mask[at:end] = 0
    return mask


def write_tokens(prefix: Path, docs: list[str], val_fraction: float, mask: bool,
                 rng) -> dict:
    """``docs`` as byte-token files at ``prefix`` (train) and ``prefix.val`` (each document
    there with probability ``val_fraction``), one document a case, no EOS; with ``mask`` the
    first key's loss mask. The metadata of each split."""
    val = rng.random(len(docs)) < val_fraction
    if val.all() or not val.any():  # before anything is written
        raise ValueError(f"{int(val.sum())} of {len(docs)} documents fell in the validation "
                         f"split (--val-fraction {val_fraction}); each split needs one: change "
                         "--docs or --val-fraction")
    out = {}
    for name, split, pick in (("train", prefix, ~val), ("validation", Path(f"{prefix}{VAL_SUFFIX}"),
                                                        val)):
        with TokenWriter(split, BYTE_VOCAB, BYTES, {"tool": "passkey_corpus"},
                         loss_mask=mask) as w:
            for text, keep in zip(docs, pick):
                if keep:
                    ids = np.frombuffer(text.encode(), dtype=np.uint8)
                    w.write_document(ids, first_key_mask(text) if mask else None)
            out[name] = w.close(split=name, eos_id=None, tokenizer_hash=BYTES)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="passkey_corpus", description=__doc__.split("\n\n")[0])
    where = ap.add_mutually_exclusive_group(required=True)
    where.add_argument("--out", help="folder to write passkey.jsonl into")
    where.add_argument("--tokens", help="token files to write instead (a prefix; --exact)")
    ap.add_argument("--docs", type=int, default=4000)
    ap.add_argument("--chars", type=int, default=240, help="about this many characters each")
    ap.add_argument("--exact", action="store_true",
                    help="exactly --chars characters each, as usp-eval's case of that length")
    ap.add_argument("--digits", type=int, default=5)
    ap.add_argument("--seed", type=int, default=12345)
    ap.add_argument("--val-fraction", type=float, default=0.02,
                    help="with --tokens: the share of documents in PREFIX.val")
    ap.add_argument("--mask-first-key", action="store_true",
                    help="with --tokens: no loss on predicting the needle's first key")
    args = ap.parse_args(argv)
    if args.docs < 1 or args.digits < 1 or args.chars < 1:
        ap.error("--docs, --digits and --chars must be >= 1")
    if args.tokens and not args.exact:
        ap.error("--tokens writes one case a document: give --exact")
    if args.mask_first_key and not args.tokens:
        ap.error("--mask-first-key is a loss mask of token files: give --tokens PREFIX")
    make = exact_document if args.exact else passkey_document
    rng = np.random.default_rng(args.seed)
    try:
        make(np.random.default_rng(args.seed), args.chars, args.digits)
    except ValueError as e:
        ap.error(str(e))
    if args.tokens:
        docs = [make(rng, args.chars, args.digits) for _ in range(args.docs)]
        try:
            metas = write_tokens(Path(args.tokens), docs, args.val_fraction,
                                 args.mask_first_key, np.random.default_rng(args.seed + 1))
        except ValueError as e:
            ap.error(str(e))
        print(f"passkey_corpus: {args.docs} documents of exactly {args.chars} characters, "
              f"{args.digits}-digit keys -> {args.tokens} ({metas['train']['num_documents']}) "
              f"and {args.tokens}{VAL_SUFFIX} ({metas['validation']['num_documents']})"
              + (", no loss on the needle's first key" if args.mask_first_key else ""))
        return 0
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
