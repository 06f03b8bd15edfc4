"""The corpus and tokenizer ``tools.bench_prepare`` tokenizes, made once and reused.

Corpus: JSONL files (``part-00000.jsonl``, ..., one ``{"text": ...}`` per line) of documents
assembled from paragraphs (blank-line separated blocks: code, comments, docstrings) of the
Python standard library's ``.py`` files, taken in sorted path order up to ``POOL_BYTES``.
A document is a run of consecutive paragraphs from a random start, jumping elsewhere with
probability ``JUMP`` after each, until it reaches a length drawn log-uniformly between
``DOC_BYTES`` (200 B to 40 KB; the mean is about 7.5 KB). Everything is drawn from
``random.Random(seed)``, so a seed and a size give the same files on the same Python.
Documents are written as they are made: memory holds the paragraph pool, never the corpus.

Both are reused when the recorded recipe matches (``manifest.json``, written last: a folder
without one is an interrupted run and is made again).
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import shutil
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

RECIPE = 1  # bump when the corpus or tokenizer recipe changes: old ones are made again
POOL_BYTES = 24 << 20  # standard-library text the documents are drawn from
DOC_BYTES = (200, 40_000)
JUMP = 0.15
FILE_BYTES = 64 << 20  # most bytes per JSONL file
MIN_FILES = 4
EOS = "<|endoftext|>"
MANIFEST = "manifest.json"
_PARAGRAPH = re.compile(r"\n[ \t]*\n")


@dataclass(frozen=True)
class Corpus:
    """A generated corpus: its folder, JSONL files (in usp-prepare's order), total bytes
    and documents."""

    folder: Path
    files: tuple[Path, ...]
    num_bytes: int
    num_documents: int
    seed: int


def stdlib_paragraphs(limit: int = POOL_BYTES) -> list[str]:
    """Paragraphs of the standard library's ``.py`` files in sorted path order, up to
    ``limit`` bytes (site-packages left out)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    pool, size = [], 0
    for folder, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in ("site-packages", "__pycache__"))
        for name in sorted(n for n in names if n.endswith(".py")):
            text = Path(folder, name).read_text(encoding="utf-8", errors="replace")
            for para in _PARAGRAPH.split(text):
                para = para.strip("\n")
                if len(para) >= 16:
                    pool.append(para)
                    size += len(para)
            if size >= limit:
                return pool
    return pool


def documents(pool: list[str], rng: random.Random) -> Iterator[str]:
    """An endless stream of documents drawn from ``pool`` (see the module docstring)."""
    lo, hi = map(math.log, DOC_BYTES)
    while True:
        target = int(math.exp(rng.uniform(lo, hi)))
        i = rng.randrange(len(pool))
        parts, size = [], 0
        while size < target:
            parts.append(pool[i])
            size += len(pool[i]) + 2
            i = rng.randrange(len(pool)) if rng.random() < JUMP else (i + 1) % len(pool)
        yield "\n\n".join(parts)


def _recipe(seed: int, target_bytes: int) -> dict:
    return {"recipe": RECIPE, "seed": seed, "target_bytes": target_bytes,
            "python": sys.version.split()[0], "pool_bytes": POOL_BYTES}


def _read_manifest(folder: Path) -> dict | None:
    try:
        return json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return None


def corpus(work_dir: Path, target_bytes: int, seed: int, log=print) -> Corpus:
    """The corpus of ``target_bytes`` (reached or passed by at most one document) for
    ``seed`` under ``work_dir``: the one found there when its recipe matches, else a new
    one."""
    folder = Path(work_dir) / f"corpus-{target_bytes}B-seed{seed}"
    recipe = _recipe(seed, target_bytes)
    found = _read_manifest(folder)
    if found is not None and {k: found.get(k) for k in recipe} == recipe and all(
            (folder / name).is_file() and (folder / name).stat().st_size == size
            for name, size in found["files"].items()):
        log(f"corpus: reusing {folder} ({found['bytes'] / 1e6:.1f} MB, "
            f"{found['documents']} documents)")
    else:
        found = _generate(folder, target_bytes, seed, recipe, log)
    files = tuple(folder / name for name in sorted(found["files"]))
    return Corpus(folder, files, found["bytes"], found["documents"], seed)


def _generate(folder: Path, target_bytes: int, seed: int, recipe: dict, log) -> dict:
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    n_files = max(MIN_FILES, math.ceil(target_bytes / FILE_BYTES))
    per_file = math.ceil(target_bytes / n_files)
    log(f"corpus: writing {target_bytes / 1e6:.1f} MB in {n_files} files to {folder} ...")
    docs = documents(stdlib_paragraphs(), random.Random(seed))
    sizes, total, count = {}, 0, 0
    for k in range(n_files):
        name = f"part-{k:05d}.jsonl"
        goal = min(per_file * (k + 1), target_bytes)  # this file ends once the total passes it
        with open(folder / name, "wb") as f:
            while total < goal:
                line = (json.dumps({"text": next(docs)}, ensure_ascii=False) + "\n").encode()
                f.write(line)
                total += len(line)
                count += 1
        sizes[name] = (folder / name).stat().st_size
    manifest = dict(recipe, bytes=total, documents=count, files=sizes)
    tmp = folder / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1))
    os.replace(tmp, folder / MANIFEST)
    log(f"corpus: {total / 1e6:.1f} MB, {count} documents")
    return manifest


def corpus_texts(files, limit: int) -> Iterator[str]:
    """The first documents of ``files`` in order, about ``limit`` bytes of them."""
    size = 0
    for path in files:
        with open(path, "rb") as f:
            for line in f:
                if size >= limit:
                    return
                size += len(line)
                yield json.loads(line)["text"]


def tokenizer(data: Corpus, vocab: int, sample_bytes: int, log=print) -> Path:
    """A byte-level BPE of ``vocab`` tokens (``EOS`` included) trained on the first
    ``sample_bytes`` of ``data``, saved as a tokenizer directory (``save_pretrained``) in
    the corpus folder; the one there is reused when it was made the same way."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    folder = data.folder / f"tokenizer-bpe{vocab}-sample{sample_bytes}B"
    recipe = {"recipe": RECIPE, "vocab": vocab, "sample_bytes": sample_bytes,
              "corpus_seed": data.seed, "corpus_bytes": data.num_bytes}
    found = _read_manifest(folder)
    if found is not None and {k: found.get(k) for k in recipe} == recipe:
        log(f"tokenizer: reusing {folder}")
        return folder
    shutil.rmtree(folder, ignore_errors=True)
    log(f"tokenizer: training a byte-level BPE of {vocab} tokens on the first "
        f"{sample_bytes / 1e6:.0f} MB ...")
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(corpus_texts(data.files, sample_bytes), trainer)
    PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=EOS).save_pretrained(str(folder))
    manifest = dict(recipe, vocab_size=bpe.get_vocab_size(with_added_tokens=True))
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return folder
