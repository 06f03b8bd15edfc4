"""Conversations for ``usp-prepare``: the chat template, the rendering of each conversation and
which of its tokens the assistant wrote (the loss mask).

A conversation is a list of ``{role, content}`` messages (the Hugging Face chat format; other
keys, such as ``reasoning_content``, reach the template as they are). It is rendered whole with
the tokenizer's chat template (transformers' ``apply_chat_template(messages, tokenize=False)``)
and the rendering is tokenized with character offsets. The template needs no generation
markers: assistant turn i starts where the rendering of the messages before it with the
generation prompt ends, when that rendering is a prefix of the whole one (else after the first
generation prompt in the whole rendering past the previous assistant turn), and ends with the
template's end-of-turn token (the first special token the template writes after an assistant's
content, e.g. ``<|im_end|>``), found by rendering a probe conversation once. What lies between
is what the whole rendering holds of the turn, so a template that rewrites earlier turns once
later ones exist (Qwen3 drops their ``<think>`` blocks) is covered as it renders them. A token is
in the mask when its first character lies in an assistant span.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from .tokenize import Encoder, TokenizerSpec

ROLES = ("system", "user", "assistant", "tool")
_PROBE = "usp probe 7f3a"  # an assistant content no template rewrites


def check_messages(messages) -> str | None:
    """Why ``messages`` is not a conversation usp trains on (a problem's reason), or None."""
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str) for m in messages):
        return "messages not a list of {role, content} strings"
    unknown = sorted({m["role"] for m in messages} - set(ROLES))
    if unknown:
        return f"unknown role {unknown[0]!r} (known: {', '.join(ROLES)})"
    if not any(m["role"] == "assistant" for m in messages):
        return "no assistant turn"
    if messages[0]["role"] == "assistant":  # transformers renders no empty prompt before it
        return "starts with an assistant turn (no prompt before it)"
    return None


def content_bytes(messages: list) -> int:
    """The UTF-8 bytes of a conversation's contents (what ``--max-bytes`` counts)."""
    return sum(len(m["content"].encode("utf-8", "replace")) for m in messages)


def chat_spec(spec: TokenizerSpec, template_file: str | Path | None) -> tuple[TokenizerSpec, str]:
    """``spec`` with the chat template it renders with (``--chat-template FILE`` over the
    tokenizer's own) and where the template came from; ValueError, before anything is
    written, for the byte tokenizer, a tokenizer without a template and no FILE, a missing
    FILE, or a template that ends an assistant turn with no special token."""
    if spec.is_bytes:
        raise ValueError("the byte tokenizer has no chat template, and conversations are "
                         "rendered with one; pass --tokenizer DIR (a Hugging Face tokenizer) "
                         "and, where it has no template, --chat-template FILE")
    if template_file is not None:
        path = Path(template_file)
        if not path.is_file():
            raise ValueError(f"--chat-template {str(path)!r} not found; pass a Jinja file "
                             "such as a model's chat_template.jinja")
        spec, where = spec.with_template(path.read_text(encoding="utf-8")), str(path)
    else:
        where = f"tokenizer {spec.source}"
    tok = spec.hf_tokenizer()
    template = getattr(tok, "chat_template", None)
    if not template:
        raise ValueError(f"tokenizer {spec.source} has no chat template, and the corpus holds "
                         "conversations; give one with --chat-template FILE (a Jinja file such "
                         "as a chat model's chat_template.jinja)")
    named = sorted(template) if isinstance(template, dict) else []
    if named:
        raise ValueError(f"tokenizer {spec.source} has several named chat templates "
                         f"({named}); pick one with --chat-template FILE")
    end_of_turn(tok)  # refused here, not once per conversation
    return spec, where


def template_hash(spec: TokenizerSpec) -> str:
    return hashlib.sha256((spec.chat_template or "").encode()).hexdigest()[:16]


def end_of_turn(tok) -> str:
    """The special token the template writes after an assistant's content (``<|im_end|>``,
    ``<|eot_id|>``, ``</s>``...); ValueError when it writes none."""
    probe = [{"role": "user", "content": "usp"}, {"role": "assistant", "content": _PROBE}]
    try:
        full = _render(tok, probe)
    except _errors() as e:  # jinja's errors, a template's raise_exception
        raise ValueError(f"the chat template cannot render a user turn and an assistant turn "
                         f"({type(e).__name__}: {e}); fix the template (--chat-template)") from None
    at = full.find(_PROBE)
    tail = full[at + len(_PROBE):] if at >= 0 else ""
    special = [t.content for t in tok.backend_tokenizer.get_added_tokens_decoder().values()
               if t.special]
    found = sorted((tail.find(s), s) for s in special if s and s in tail)
    if not found:
        raise ValueError(f"the chat template writes no special token after an assistant's "
                         f"content (it writes {tail[:40]!r}), so usp cannot tell where the "
                         "turn ends nor teach the model to stop; use a template that ends each "
                         "assistant turn with its end-of-turn token (--chat-template)")
    return found[0][1]


def _errors() -> tuple:
    """What rendering a template raises: jinja's errors (a template's ``raise_exception``
    among them) and the Python errors of a template reading what a message lacks."""
    from jinja2 import TemplateError

    return (TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError)


def _render(tok, messages: list, prompt: bool = False) -> str:
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)


class _Skip(Exception):
    """A conversation the template cannot render the way usp reads it (the reason)."""


def assistant_spans(tok, messages: list, end: str) -> tuple[str, list[tuple[int, int]]]:
    """The whole rendering of ``messages`` and each assistant turn's character span in it:
    from the end of its generation prompt (``_turn_start``) through the first ``end`` token
    after that."""
    try:
        full = _render(tok, messages)
    except _errors() as e:
        raise _Skip(f"the chat template refused it ({type(e).__name__}: "
                    f"{str(e).splitlines()[0] if str(e) else ''})") from None
    spans, last = [], 0
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start = _turn_start(tok, messages, i, full, last)
        stop = full.find(end, start)
        if stop < 0:
            raise _Skip(f"assistant turn {i} has no {end} in the rendering")
        spans.append((start, stop + len(end)))
        last = spans[-1][1]
    return full, spans


def _turn_start(tok, messages: list, i: int, full: str, last: int) -> int:
    """Where assistant turn i's text starts in ``full``: after the rendering of the messages
    before it with the generation prompt, when that is a prefix of ``full``; else (a template
    that renders an earlier turn differently once later turns exist, e.g. Qwen3's reasoning
    kept through tool calls until the next user turn) after the first generation prompt in
    ``full`` past the previous assistant turn (``last``)."""
    head = _try_render(tok, messages[:i], True)
    if head is not None and full.startswith(head) and len(head) >= last:
        return len(head)
    bare = None if head is None else _try_render(tok, messages[:i], False)
    if bare is not None and head.startswith(bare) and head != bare:
        prompt = head[len(bare):]
        at = full.find(prompt, last)
        if at >= 0:
            return at + len(prompt)
    raise _Skip(f"the chat template renders no generation prompt before assistant turn {i} "
                "that the whole conversation holds")


def _try_render(tok, messages: list, prompt: bool) -> str | None:
    try:
        return _render(tok, messages, prompt)
    except _errors():
        return None


def token_mask(offsets, spans) -> np.ndarray:
    """1 for each token whose first character lies in one of ``spans``."""
    starts = np.fromiter((o[0] for o in offsets), np.int64, len(offsets))
    mask = np.zeros(len(offsets), np.uint8)
    for a, b in spans:
        mask[(starts >= a) & (starts < b)] = 1
    return mask


class ChatEncoder:
    """Renders and tokenizes conversations with a ``TokenizerSpec`` holding a chat template (in
    any process). ``encode(conversations)`` -> (ids uint32, lengths int64, loss uint8 [one a
    token], reasons: None per conversation written, else why it was skipped (length 0))."""

    def __init__(self, spec: TokenizerSpec):
        self.tok = spec.hf_tokenizer()
        self.end = end_of_turn(self.tok)

    def encode(self, conversations: list):
        ids, masks, lengths, reasons = [], [], [], []
        for messages in conversations:
            try:
                full, spans = assistant_spans(self.tok, messages, self.end)
            except _Skip as e:
                lengths.append(0)
                reasons.append(str(e))
                continue
            enc = self.tok.backend_tokenizer.encode(full, add_special_tokens=False)
            ids.append(np.asarray(enc.ids, np.uint32))
            masks.append(token_mask(enc.offsets, spans))
            lengths.append(len(enc.ids))
            reasons.append(None)
        return (_cat(ids, np.uint32), np.asarray(lengths, np.int64), _cat(masks, np.uint8),
                reasons)


def _cat(arrays: list, dtype) -> np.ndarray:
    return np.concatenate(arrays) if arrays else np.zeros(0, dtype)


def encoder_for(state):
    """The encoder a worker builds: ``ChatEncoder`` for a ``TokenizerSpec``, else ``Encoder``."""
    return ChatEncoder(state) if isinstance(state, TokenizerSpec) else Encoder(state)
