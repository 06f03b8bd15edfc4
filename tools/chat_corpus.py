"""Conversations for the chat fine-tuning miniature (docs/data.md): the user's turn hides
a key among random letters, the assistant answers it; and a ChatML tokenizer to prepare
them with.

    python -m tools.chat_corpus --out data/chat_src --conversations 3000 --held-out 100
    usp-prepare --src data/chat_src/train --glob '*.jsonl' --out data/chat \
        --tokenizer data/chat_src/tokenizer --workers 1
    ... usp-train, usp-export ...
    python -m tools.chat_corpus answer --export runs/X/export --conversations \
        data/chat_src/held_out.jsonl

A conversation (JSONL, ``{"messages": [...]}``, the Hugging Face chat format): the user's
turn is ``--letters`` random letters (a length drawn uniformly from the range) with
``key K`` at a random place and ``what is the key ?`` last; the assistant's turn is ``K``,
one of ten digits (chance 10%). A share (``--system``) opens with a system turn. Only the
assistant's tokens carry information a model can learn: the letters are random, so a
model trained on every token (``data.loss_on=all``) keeps their loss, about ln 26 a letter.

The tokenizer (``tokenizer/``): word level over the letters, digits and the few words,
with ``<|im_start|>``, ``<|im_end|>`` and ``<|endoftext|>`` special, and a ChatML chat
template without generation markers. ``answer`` loads an export with transformers, renders
each held-out conversation's turns before the assistant's with ``apply_chat_template(...,
add_generation_prompt=True)``, generates greedily and prints the share answered right.
"""

from __future__ import annotations

import argparse
import json
import string
from pathlib import Path

import numpy as np

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
WORDS = ("user", "assistant", "system", "key", "what", "is", "the", "?", "you", "answer",
         "keys")
SYSTEM = "you answer the key"


def conversation(rng, letters: tuple[int, int], system: float) -> dict:
    """One conversation (see the module docstring), drawn from ``rng``."""
    n = int(rng.integers(letters[0], letters[1] + 1))
    text = list(rng.choice(list(string.ascii_lowercase), n))
    key = str(int(rng.integers(0, 10)))
    at = int(rng.integers(0, n + 1))
    user = " ".join(text[:at] + ["key", key] + text[at:] + ["what", "is", "the", "key", "?"])
    messages = [{"role": "user", "content": user}, {"role": "assistant", "content": key}]
    if rng.random() < system:
        messages.insert(0, {"role": "system", "content": SYSTEM})
    return {"messages": messages}


def chatml_tokenizer(path: Path) -> Path:
    """The word-level ChatML tokenizer of the module docstring, saved at ``path``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = list(SPECIAL) + ["[UNK]"] + list(WORDS) + list(string.ascii_lowercase) \
        + [str(d) for d in range(10)]
    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)},
                                     unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(list(SPECIAL))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>", unk_token="[UNK]")
    fast.chat_template = CHATML
    fast.save_pretrained(str(path))
    return path


def write(out: Path, conversations: int, held_out: int, letters: tuple[int, int],
          system: float, seed: int) -> None:
    """``out/train/part-0.jsonl`` (``conversations``), ``out/held_out.jsonl`` (``held_out``,
    another stream of the seed) and ``out/tokenizer/``."""
    (out / "train").mkdir(parents=True, exist_ok=True)
    for name, n, stream in (("train/part-0.jsonl", conversations, 0),
                            ("held_out.jsonl", held_out, 1)):
        rng = np.random.default_rng([seed, stream])
        with open(out / name, "w") as f:
            for _ in range(n):
                f.write(json.dumps(conversation(rng, letters, system)) + "\n")
    chatml_tokenizer(out / "tokenizer")


def answer(export: Path, path: Path, limit: int | None = None) -> float:
    """The share of ``path``'s conversations whose last assistant turn the export, greedy
    through transformers' ``generate`` after ``apply_chat_template(...,
    add_generation_prompt=True)``, answers exactly."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(export), local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(str(export), local_files_only=True).eval()
    lines = path.read_text().splitlines()[:limit]
    right = 0
    for line in lines:
        messages = json.loads(line)["messages"]
        ids = tok.apply_chat_template(messages[:-1], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)["input_ids"]
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=2, do_sample=False,
                                 pad_token_id=tok.pad_token_id)
        said = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()
        right += said == messages[-1]["content"]
    return right / len(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("mode", nargs="?", choices=("write", "answer"), default="write")
    p.add_argument("--out", type=Path, help="write: the folder of conversations and tokenizer")
    p.add_argument("--conversations", type=Path, default=None,
                   help="answer: the held-out JSONL")
    p.add_argument("--count", type=int, default=3000, help="write: training conversations")
    p.add_argument("--held-out", type=int, default=100)
    p.add_argument("--letters", type=int, nargs=2, default=(8, 200), metavar=("LO", "HI"))
    p.add_argument("--system", type=float, default=0.3, help="share with a system turn")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--export", type=Path, help="answer: an usp-export directory")
    p.add_argument("--limit", type=int, default=None)
    a = p.parse_args(argv)
    if a.mode == "write":
        if a.out is None:
            p.error("write needs --out")
        write(a.out, a.count, a.held_out, tuple(a.letters), a.system, a.seed)
        print(f"chat_corpus: {a.count} + {a.held_out} conversations and a ChatML tokenizer "
              f"in {a.out}")
    else:
        if a.export is None or a.conversations is None:
            p.error("answer needs --export and --conversations")
        share = answer(a.export, a.conversations, a.limit)
        print(f"chat_corpus: {share:.1%} of {a.conversations} answered")


if __name__ == "__main__":
    main()
