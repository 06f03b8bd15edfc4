"""Conversation token files as usp-prepare writes them for chat data (one conversation a
document, the assistant's tokens in the loss mask, ``loss_kind: assistant``), made with
``TokenWriter`` directly: random tokens, lengths and assistant spans."""

import numpy as np

from usp.data.files import TokenWriter


def conversation_mask(n: int, rng) -> np.ndarray:
    """A 0/1 mask [n]: alternating user (0) and assistant (1) turns of random lengths, the
    first a user turn."""
    mask, at, turn = np.zeros(n, dtype=np.uint8), 0, 0
    while at < n:
        step = int(rng.integers(1, max(2, n // 3) + 1))
        mask[at:at + step] = turn
        at, turn = at + step, 1 - turn
    return mask


def write_chat(prefix, lengths, vocab: int = 128, seed: int = 0, kind: str | None = "assistant",
               mask: bool = True) -> list[np.ndarray]:
    """Conversations of ``lengths`` tokens at ``prefix``; returns their tokens. ``kind``: the
    metadata's ``loss_kind`` (None: not recorded); ``mask=False``: no loss mask at all."""
    rng = np.random.default_rng(seed)
    docs = [rng.integers(1, vocab, int(n)) for n in lengths]
    extra = {} if kind is None else {"loss_kind": kind, "chat": True}
    with TokenWriter(prefix, vocab, "test", {"test": 1}, loss_mask=mask) as w:
        for d in docs:
            w.write_document(d, conversation_mask(d.size, rng) if mask else None)
        w.close(**extra)
    return docs
