"""The chat form of passkey retrieval (``eval.chat=true``): what the model's chat template
puts around a user's turn and before the assistant's answer, as token ids.

The template renders a two-turn conversation whose contents are sentinels; the text before
the user's sentinel is the ``opening``, the text between it and the assistant's sentinel the
``turn`` (the user's end, the assistant's header). Each is encoded on its own, without the
special tokens the tokenizer would add, and the case's tokens are ``opening + haystack,
needle, question + turn + key``: a chat template's special tokens (``<|im_start|>``,
``<|im_end|>``) split the text into the same pieces when the whole conversation is encoded.
"""

from __future__ import annotations

from .passkey import ChatFrame, HFTokenizer

USER, ASSISTANT = "\x00usp-user\x00", "\x00usp-assistant\x00"  # no template writes these


def chat_frame(tok) -> ChatFrame:
    """The ``ChatFrame`` of ``tok`` (an ``HFTokenizer``); ValueError, with the fix, for a
    tokenizer without a chat template or a template that does not render the turns' contents
    as given."""
    inner = getattr(tok, "tok", None) if isinstance(tok, HFTokenizer) else None
    if inner is None or not getattr(inner, "chat_template", None):
        what = "the byte tokenizer" if inner is None else "its tokenizer"
        raise ValueError(f"eval.chat=true asks the passkey question as a conversation, but "
                         f"{what} has no chat template; score a model whose tokenizer has "
                         "one (usp-prepare --chat-template FILE) or set eval.chat=false")
    messages = [{"role": "user", "content": USER}, {"role": "assistant", "content": ASSISTANT}]
    text = inner.apply_chat_template(messages, tokenize=False)
    if text.count(USER) != 1 or text.count(ASSISTANT) != 1 or \
            text.index(USER) > text.index(ASSISTANT):
        raise ValueError("eval.chat=true: the tokenizer's chat template does not render a "
                         "user turn followed by an assistant turn with their contents as "
                         "given; set eval.chat=false")
    opening, rest = text.split(USER)
    turn = rest.split(ASSISTANT)[0]
    return ChatFrame(tuple(tok.encode(opening)), tuple(tok.encode(turn)))
