"""Passkey retrieval (Mohtashami & Jaggi 2023) as pure case generation and scoring.

A case is one sequence of exactly ``length`` tokens: a haystack (the protocol's filler
sentences repeated, or text of a validation split) with the needle "The pass key is K.
Remember it. K is the pass key." inserted at a token boundary at ``depth`` of it (0: the
start, 1: the end), then the question "What is the pass key? The pass key is" and the
key's tokens. Everything goes through the model's tokenizer (``ByteTokenizer`` for byte
tokens). Scoring is teacher-forced: one forward pass over the whole case; it passes when the
argmax at every key-token position is the key's token (``SCORING``); the key's mean
log-likelihood is recorded too. No torch here: the runner (``usp.eval.runner``) feeds the
model and hands back each position's loss and argmax.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import numpy as np

FILLER = ("The grass is green. The sky is blue. The sun is yellow. Here we go. There and "
          "back again. ")
NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key. "
QUESTION = " What is the pass key? The pass key is"
CHAT_QUESTION = " What is the pass key?"  # chat form: the assistant's turn answers it
SCORING = ("teacher-forced exact match: a case passes when the argmax at every key-token "
           "position is the key's token; key_logprob is the key tokens' mean log-likelihood")


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """The byte tokenizer of ``usp-prepare --tokenizer bytes``: ids are the UTF-8 bytes."""

    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


class HFTokenizer:
    """A transformers tokenizer, without the special tokens it would add."""

    def __init__(self, tok):
        self.tok, self.vocab_size = tok, len(tok)

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(list(ids))


@dataclass(frozen=True)
class Case:
    """One passkey case: ``tokens`` (exactly ``length`` ids) whose last ``key_len`` ids are
    the key's (the scored ones), from ``key_start``; the needle begins at ``needle_at``."""

    length: int
    depth: float
    key: str
    tokens: tuple[int, ...]
    key_start: int
    needle_at: int

    @property
    def key_len(self) -> int:
        return self.length - self.key_start


def answer_ids(tok: Tokenizer, key: str, vocab_size: int,
               lead: str = " ") -> tuple[list[int], int]:
    """(the ids of the answer ``lead + KEY``, how many of its last ids are scored: all, less
    a leading id that is the space alone, as the byte tokenizer's). ValueError when the
    tokenizer cannot encode the key (it does not decode back, or an id is past the model's
    vocabulary). ``lead=""``: the key alone (the chat form's assistant turn)."""
    ids = tok.encode(lead + key)
    space = tok.encode(" ")
    scored = ids[1:] if len(space) == 1 and len(ids) > 1 and ids[0] == space[0] else ids
    back = tok.decode(scored).strip()
    if back != key or not ids or max(ids) >= vocab_size:
        raise ValueError(f"the tokenizer cannot encode the key {key!r}: its ids {ids} decode "
                         f"to {back!r} (model vocabulary {vocab_size}); use a tokenizer with "
                         "digits, the one the model was trained with")
    return ids, len(scored)


def _cell_seed(seed: int, length: int, depth: float, i: int, what: int) -> list[int]:
    """The seed of case ``i`` of cell (length, depth): the same whatever else is scored."""
    return [seed, length, round(depth * 10**6), i, what]


def random_key(digits: int, seed: int, length: int, depth: float, i: int) -> str:
    """The ``i``-th key of cell (``length``, ``depth``): ``digits`` digits, the first not 0,
    seeded (``_cell_seed``)."""
    rng = np.random.default_rng(_cell_seed(seed, length, depth, i, 0))
    return str(rng.integers(1, 10)) + "".join(str(d) for d in rng.integers(0, 10, digits - 1))


def filler_haystack(tok: Tokenizer):
    """A haystack of the protocol's filler: ``n`` ids of FILLER's tokens repeated (cut at a
    token boundary)."""
    unit = tok.encode(FILLER)

    def haystack(n: int, rng) -> list[int]:
        return (unit * (n // len(unit) + 1))[:n]

    return haystack


def text_haystack(text: np.ndarray, what: str = "the validation split"):
    """A haystack of ``n`` consecutive ids of ``text`` (token ids, e.g. a validation split)
    from a seeded random offset."""

    def haystack(n: int, rng) -> list[int]:
        if n > len(text):
            raise ValueError(f"a passkey case needs {n} haystack tokens but {what} holds "
                             f"{len(text)}; use shorter eval.lengths (at most about "
                             f"{len(text)}) or eval.haystack=filler")
        start = int(rng.integers(0, len(text) - n + 1))
        return [int(t) for t in text[start:start + n]]

    return haystack


@dataclass(frozen=True)
class ChatFrame:
    """The chat form of a case (``usp.eval.chat.chat_frame``): the ids a chat template puts
    before the user's turn's content (``opening``) and between it and the assistant's
    content (``turn``)."""

    opening: tuple[int, ...]
    turn: tuple[int, ...]


def make_case(tok: Tokenizer, length: int, depth: float, key: str, haystack, vocab_size: int,
              rng, frame: ChatFrame | None = None) -> Case:
    """The case of ``key`` at ``depth`` in ``length`` tokens (see the module docstring).
    ``frame``: in chat form, the haystack, needle and ``CHAT_QUESTION`` are the user's turn
    and the key alone the assistant's."""
    if frame is None:
        answer, scored = answer_ids(tok, key, vocab_size)
        before, question = [], tok.encode(QUESTION)
    else:
        answer, scored = answer_ids(tok, key, vocab_size, lead="")
        before, question = list(frame.opening), tok.encode(CHAT_QUESTION) + list(frame.turn)
    needle = tok.encode(NEEDLE.format(key=key))
    n = length - len(before) - len(needle) - len(question) - len(answer)
    if n < 0:
        raise ValueError(f"eval.lengths has {length}: a passkey case needs at least "
                         f"{length - n} tokens (needle, question and key); use longer lengths")
    hay = haystack(n, rng)
    at = round(depth * n)  # a token boundary of the haystack
    tokens = before + hay[:at] + needle + hay[at:] + question + answer
    return Case(length, depth, key, tuple(tokens), length - scored, len(before) + at)


def passkey_cases(tok: Tokenizer, lengths: Sequence[int], depths: Sequence[float],
                  per_cell: int, key_digits: int, seed: int, vocab_size: int,
                  haystack=None, frame: ChatFrame | None = None) -> list[Case]:
    """Every case of the grid, lengths outer, then depths, then ``per_cell`` keys; seeded by
    ``seed`` (the same cases every time). ``haystack``: ``text_haystack``/``filler_haystack``
    (default: the filler); ``frame``: the chat form (``make_case``). ValueError for a depth outside [0, 1] or a key the tokenizer
    cannot encode, before any model runs."""
    bad = [d for d in depths if not 0.0 <= d <= 1.0]
    if bad:
        raise ValueError(f"depths {bad} are outside [0, 1]; use e.g. eval.depths=[0,0.5,1]")
    haystack = haystack or filler_haystack(tok)
    cases = []
    for length in lengths:
        for depth in depths:
            for i in range(per_cell):
                rng = np.random.default_rng(_cell_seed(seed, length, depth, i, 1))
                key = random_key(key_digits, seed, length, depth, i)
                cases.append(make_case(tok, length, depth, key, haystack, vocab_size, rng,
                                       frame))
    return cases


def case_labels(case: Case) -> list[int]:
    """The labels of ``case`` as the model takes them (position t predicts token t+1): the
    key's ids at the positions that predict them, -100 elsewhere."""
    labels = [-100] * case.length
    for t in range(case.key_start - 1, case.length - 1):
        labels[t] = case.tokens[t + 1]
    return labels


def score(case: Case, losses: Sequence[float], predictions: Sequence[int]) -> dict:
    """{"length", "depth", "key", "passed", "key_logprob"} of ``case`` from each position's
    loss and argmax over the whole case (global order)."""
    rows = range(case.key_start - 1, case.length - 1)
    passed = all(int(predictions[t]) == case.tokens[t + 1] for t in rows)
    logprob = -sum(float(losses[t]) for t in rows) / len(rows)
    return {"length": case.length, "depth": case.depth, "key": case.key, "passed": passed,
            "key_logprob": logprob}


def cell_passes(scores: list[dict], length: int, depth: float) -> list[bool]:
    """Whether each scored case of cell (``length``, ``depth``) passed."""
    return [s["passed"] for s in scores if s["length"] == length and s["depth"] == depth]


def accuracy_grid(scores: list[dict], lengths: Sequence[int],
                  depths: Sequence[float]) -> list[list[float]]:
    """Pass rate per (length, depth), lengths x depths."""
    grid = []
    for length in lengths:
        row = []
        for depth in depths:
            cell = cell_passes(scores, length, depth)
            row.append(sum(cell) / len(cell) if cell else float("nan"))
        grid.append(row)
    return grid
