"""Small Hugging Face tokenizers made on the spot (offline) and a JSONL corpus with bad lines,
for the tests of usp-prepare, vocab_size=auto and usp-export."""

from __future__ import annotations

import json
import random
from pathlib import Path

EOS = "<|endoftext|>"
WORDS = ("the cat sat on a mat while dogs bark at night and birds sing old songs of the sea "
         "ring ulysses token window attention layer").split()


def texts(n: int, seed: int = 0, lo: int = 3, hi: int = 40) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choices(WORDS, k=rng.randint(lo, hi))) for _ in range(n)]


def bpe(vocab_size: int = 300, eos: str | None = EOS, corpus: list[str] | None = None):
    """A byte-level BPE ``tokenizers.Tokenizer`` trained on ``corpus`` (default ``texts``);
    ``eos``: its one special token, or None for none."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[eos] if eos else [],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(corpus or texts(200), trainer)
    return tok


def save_dir(tok, path: Path, eos: str | None = EOS) -> Path:
    """``tok`` as a tokenizer directory ``AutoTokenizer.from_pretrained`` loads."""
    from transformers import PreTrainedTokenizerFast

    kw = {"eos_token": eos} if eos else {}
    PreTrainedTokenizerFast(tokenizer_object=tok, **kw).save_pretrained(str(path))
    return path


def word_level(size: int):
    """A word-level tokenizer of ``size`` ids (w0, w1, ...; the last is ``EOS``)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(size - 2)}
    vocab.update({"[UNK]": size - 2, EOS: size - 1})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([EOS])
    return tok


def jsonl_corpus(folder: Path, docs: list[str], bad: bool = True, key: str = "text") -> Path:
    """``folder/part-0.jsonl`` and ``part-1.jsonl`` holding ``docs`` in order, plus (``bad``)
    one line that is not JSON, one without the key and one whose text is a number, and a
    blank line, at known places: part-0.jsonl lines 3, 4 and 5."""
    folder.mkdir(parents=True, exist_ok=True)
    half = len(docs) // 2
    lines = [json.dumps({key: t, "id": i}) for i, t in enumerate(docs[:half])]
    if bad:
        lines[2:2] = ["{not json", json.dumps({"body": "x"}), json.dumps({key: 7}), ""]
    (folder / "part-0.jsonl").write_text("\n".join(lines) + "\n")
    (folder / "part-1.jsonl").write_text(
        "".join(json.dumps({key: t}) + "\n" for t in docs[half:]))
    return folder
