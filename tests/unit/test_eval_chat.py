"""The passkey in chat form (``eval.chat=true``, ``usp.eval.chat``): the case is the
tokenizer's own encoding of the conversation [user: haystack, needle, question; assistant:
the key] up to the key, the key's ids are the scored ones, and a tokenizer without a chat
template is refused."""

import pytest

from usp.eval.chat import chat_frame
from usp.eval.passkey import CHAT_QUESTION, NEEDLE, ByteTokenizer, HFTokenizer, passkey_cases

from _chat import CHATML
from _tokenizers import bpe


def _tok(template=CHATML):
    from transformers import PreTrainedTokenizerFast

    raw = bpe(400, eos="<|endoftext|>")
    raw.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<|endoftext|>")
    tok.chat_template = template
    return tok


def test_a_chat_case_is_the_conversation_encoded_up_to_its_key():
    hf = _tok()
    tok = HFTokenizer(hf)
    frame = chat_frame(tok)
    cases = passkey_cases(tok, [160, 240], [0.0, 0.5, 1.0], 2, 5, 0, len(hf), frame=frame)
    for c in cases:
        assert len(c.tokens) == c.length
        key = list(c.tokens[c.key_start:])
        assert tok.decode(key) == c.key  # the scored ids are the key's alone
        user = tok.decode(c.tokens[len(frame.opening):c.key_start - len(frame.turn)])
        assert user.endswith(CHAT_QUESTION) and NEEDLE.format(key=c.key) in user
        assert tok.decode(c.tokens[c.needle_at:]).startswith(NEEDLE.format(key=c.key))
        whole = hf.apply_chat_template([{"role": "user", "content": user},
                                        {"role": "assistant", "content": c.key}], tokenize=False)
        # the case decodes to the rendered conversation up to the key, and the template's
        # special tokens split it where the frame did: the same ids as encoding it whole
        assert whole.startswith(tok.decode(c.tokens))
        if c.depth == 0.0:
            assert list(c.tokens) == tok.encode(whole)[:c.length]


def test_a_tokenizer_without_a_chat_template_is_refused():
    with pytest.raises(ValueError, match="no chat template.*eval.chat=false"):
        chat_frame(ByteTokenizer())
    with pytest.raises(ValueError, match="its tokenizer has no chat template"):
        chat_frame(HFTokenizer(_tok(template=None)))
    with pytest.raises(ValueError, match="does not render a user turn"):
        chat_frame(HFTokenizer(_tok(template="{{ messages[0].content }}")))


def test_the_haystack_of_conversations_is_the_filler(tmp_path):
    """Token files of rendered conversations (``"chat": true``) are no haystack: their text
    holds the template's markers, so ``eval.haystack=auto`` takes the filler there and the
    validation text elsewhere."""
    from usp.eval.grid import chat_data

    from _chat_files import write_chat

    write_chat(tmp_path / "chat", [40] * 4)
    write_chat(tmp_path / "plain", [40] * 4, kind=None)
    assert chat_data(str(tmp_path / "chat")) is True
    assert chat_data(str(tmp_path / "plain")) is False and chat_data(None) is False
