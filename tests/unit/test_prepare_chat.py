"""usp-prepare on conversations, in one process: the assistant mask against hand-computed
spans (ChatML, and a Qwen3-like template that drops earlier turns' <think> blocks), Parquet,
bad conversations counted with file:line or refused, refusals that write nothing, and the chat
template that travels with the tokenizer to usp-train's run and usp-export."""

from __future__ import annotations

import json
import pickle
import random
from itertools import pairwise

import numpy as np
import pytest
from _chat import CHATML, END, QWEN3_LIKE, chat_tokenizer, conversation, write_jsonl

from usp.data.chat import encoder_for
from usp.data.prepare import main, prepare
from usp.data.sources import in_validation
from usp.data.tokenize import load_tokenizer

pytest.importorskip("transformers")
pytest.importorskip("jinja2")

FRACTION = 0.3


def _quiet(**kw):
    return {"log": lambda line: None, **kw}


@pytest.fixture(scope="module")
def toks(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat_tok")
    return {"chatml": chat_tokenizer(root / "chatml", CHATML),
            "qwen3": chat_tokenizer(root / "qwen3", QWEN3_LIKE),
            "none": chat_tokenizer(root / "none", None)}


def _split(prefix) -> list[tuple[np.ndarray, np.ndarray]]:
    """(ids, loss) per document of the token files at ``prefix``."""
    ids = np.fromfile(f"{prefix}.bin", np.uint16)
    loss = np.fromfile(f"{prefix}.loss", np.uint8)
    starts = [*np.fromfile(f"{prefix}.docs", "<i8").tolist(), ids.size]
    return [(ids[a:b], loss[a:b]) for a, b in pairwise(starts)]


def _runs(ids, loss, tok) -> list[str]:
    """The decoded text of each run of masked tokens."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], loss, [0]])))
    return [tok.decode(ids[a:b].tolist()) for a, b in zip(edges[::2], edges[1::2])]


def _turns_chatml(msgs) -> list[str]:
    return [m["content"] + END for m in msgs if m["role"] == "assistant"]


def _turns_qwen3(msgs) -> list[str]:
    """By hand: an assistant turn after the last user turn keeps its reasoning in a <think>
    block; an earlier one is its answer alone."""
    last_user = max(i for i, m in enumerate(msgs) if m["role"] == "user")
    out = []
    for i, m in enumerate(msgs):
        if m["role"] != "assistant":
            continue
        think, _, answer = m["content"].rpartition("</think>")
        reason = think.split("<think>")[-1].strip("\n")
        answer = answer.lstrip("\n")
        out.append(f"<think>\n{reason}\n</think>\n\n{answer}{END}" if i > last_user
                   else answer + END)
    return out


@pytest.mark.parametrize("name,think,turns_of", [("chatml", False, _turns_chatml),
                                                 ("qwen3", True, _turns_qwen3)])
def test_the_mask_is_each_assistant_turn_and_its_end_token(tmp_path, toks, name, think,
                                                           turns_of):
    from transformers import AutoTokenizer

    rng = random.Random(3)
    convs = [conversation(rng, 1 + i % 3, think=think, system=i % 2 == 0, tool=i % 4 == 3)
             for i in range(24)]
    write_jsonl(tmp_path / "src" / "a.jsonl", [{"messages": c} for c in convs])
    meta = prepare(tmp_path / "src", "*.jsonl", tmp_path / "out" / "c", tokenizer=toks[name],
                   val_fraction=FRACTION, **_quiet())
    tok = AutoTokenizer.from_pretrained(str(toks[name]))
    val = [in_validation(f"a.jsonl:{n}", FRACTION) for n in range(1, len(convs) + 1)]
    assert 0 < sum(val) < len(convs)
    for prefix, mine in ((tmp_path / "out" / "c", [not v for v in val]),
                         (tmp_path / "out" / "c.val", val)):
        docs = _split(prefix)
        wanted = [c for c, m in zip(convs, mine) if m]
        assert len(docs) == len(wanted)
        for (ids, loss), msgs in zip(docs, wanted):
            text = tok.apply_chat_template(msgs, tokenize=False)
            assert ids.tolist() == tok(text, add_special_tokens=False).input_ids + [
                tok.eos_token_id]  # the rendering, then EOS
            assert loss[-1] == 0  # no loss on the EOS usp-prepare appends
            assert _runs(ids, loss, tok) == turns_of(msgs)
    assert meta["loss_kind"] == "assistant" and meta["chat"] is True and meta["loss_mask"]
    assert meta["chat_template"] == f"tokenizer {toks[name]}"
    assert meta["loss_tokens"] == sum(int(loss.sum()) for _, loss in _split(tmp_path / "out/c"))
    assert meta["val"]["num_documents"] == sum(val)
    assert json.loads((tmp_path / "out" / "c.val.json").read_text())["loss_kind"] == "assistant"


def test_parquet_and_a_renamed_messages_key_give_the_jsonl_files(tmp_path, toks):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    rng = random.Random(4)
    convs = [conversation(rng, 2) for _ in range(6)]
    write_jsonl(tmp_path / "j" / "a.jsonl", [{"messages": c} for c in convs])
    (tmp_path / "p").mkdir()
    pq.write_table(pa.table({"conv": convs, "id": list(range(6))}), tmp_path / "p" / "a.parquet")
    prepare(tmp_path / "j", "*", tmp_path / "out" / "j", tokenizer=toks["chatml"],
            val_fraction=0, **_quiet())
    meta = prepare(tmp_path / "p", "*", tmp_path / "out" / "p", tokenizer=toks["chatml"],
                   val_fraction=0, messages_key="conv", **_quiet())
    for ext in ("bin", "loss", "docs"):
        assert (tmp_path / f"out/p.{ext}").read_bytes() == (tmp_path / f"out/j.{ext}").read_bytes()
    assert meta["num_documents"] == 6 and meta["source"]["messages_key"] == "conv"


BAD = [
    ([{"role": "user", "content": "the cat"}], "conversation skipped, no assistant turn"),
    ([{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}],
     "conversation skipped, unknown role 'robot' (known: system, user, assistant, tool)"),
    ("the cat sat", "conversation skipped, messages not a list of {role, content} strings"),
    ([{"role": "user", "content": "a"}, {"role": "assistant", "content": 7}],
     "conversation skipped, messages not a list of {role, content} strings"),
    ([{"role": "assistant", "content": "a"}],
     "conversation skipped, starts with an assistant turn (no prompt before it)"),
]


def test_bad_conversations_are_counted_with_file_and_line(tmp_path, toks):
    good = conversation(random.Random(5), 2)
    records = [{"messages": good}] + [{"messages": m} for m, _ in BAD] + [{"messages": good}]
    write_jsonl(tmp_path / "src" / "a.jsonl", records)
    lines = []
    meta = prepare(tmp_path / "src", "*.jsonl", tmp_path / "out" / "c", tokenizer=toks["chatml"],
                   val_fraction=0, **_quiet(log=lines.append))
    assert meta["num_documents"] == 2 and meta["problems"]["counts"]
    counts, examples = meta["problems"]["counts"], meta["problems"]["examples"]
    assert counts == {BAD[0][1]: 1, BAD[1][1]: 1, BAD[2][1]: 2, BAD[4][1]: 1}
    assert examples[BAD[4][1]] == ["a.jsonl:6"]
    assert examples[BAD[0][1]] == ["a.jsonl:2"] and examples[BAD[1][1]] == ["a.jsonl:3"]
    assert examples[BAD[2][1]] == ["a.jsonl:4", "a.jsonl:5"]
    assert f"  {BAD[2][1]}: 2 (e.g. a.jsonl:4, a.jsonl:5)" in lines
    assert any(line.startswith("  chat: 2 conversations, template from tokenizer ")
               for line in lines)


def test_conversations_the_template_refuses_or_prompts_unlike_it_renders_are_skipped(
        tmp_path, toks):
    """A template that raises on a content, and prompts one message with a generation
    prompt its renderings never hold (so no assistant turn can be found after it)."""
    (tmp_path / "t.jinja").write_text(
        "{% for m in messages %}{% if m.content == 'forbidden' %}{{ raise_exception('no') }}"
        "{% endif %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>{% if messages|length == 1 %}bot"
        "{% else %}assistant{% endif %}{{ '\\n' }}{% endif %}")
    user, answer = {"role": "user", "content": "the"}, {"role": "assistant", "content": "the cat"}
    write_jsonl(tmp_path / "src" / "a.jsonl", [
        {"messages": [{"role": "user", "content": "forbidden"}, answer]},
        {"messages": [user, answer]},
        {"messages": [{"role": "system", "content": "sat"}, user, answer]}])
    meta = prepare(tmp_path / "src", "*.jsonl", tmp_path / "out" / "c", tokenizer=toks["none"],
                   chat_template=tmp_path / "t.jinja", val_fraction=0, **_quiet())
    assert meta["num_documents"] == 1 and meta["problems"]["examples"] == {
        "conversation skipped, the chat template refused it (TemplateError: no)": ["a.jsonl:1"],
        "conversation skipped, the chat template renders no generation prompt before "
        "assistant turn 1 that the whole conversation holds": ["a.jsonl:2"]}
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(toks["none"]))
    (ids, loss), = _split(tmp_path / "out" / "c")
    assert _runs(ids, loss, tok) == ["the cat<|im_end|>"]


@pytest.mark.parametrize("record,needle", [(m, why) for m, why in BAD[:2]])
def test_strict_refuses_a_bad_conversation_and_writes_nothing(tmp_path, toks, record, needle):
    write_jsonl(tmp_path / "src" / "a.jsonl", [{"messages": conversation(random.Random(6), 1)},
                                               {"messages": record}])
    with pytest.raises(ValueError, match="a.jsonl:2: " + needle.replace("(", r"\(")
                       .replace(")", r"\)")):
        prepare(tmp_path / "src", "*.jsonl", tmp_path / "out" / "c", tokenizer=toks["chatml"],
                strict=True, **_quiet())
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").iterdir())


def _refused(tmp_path, records, needle, **kw):
    write_jsonl(tmp_path / "src" / "a.jsonl", records)
    with pytest.raises(ValueError) as err:
        prepare(tmp_path / "src", "*.jsonl", tmp_path / "out" / "c", **_quiet(**kw))
    assert needle in str(err.value) and "\n" not in str(err.value)
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").iterdir())


CHAT = [{"messages": conversation(random.Random(7), 2)}]


def test_the_byte_tokenizer_is_refused_for_conversations(tmp_path, capsys):
    _refused(tmp_path, CHAT, "the byte tokenizer has no chat template")
    assert main(["--src", str(tmp_path / "src"), "--glob", "*.jsonl", "--out",
                 str(tmp_path / "out" / "c"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("usp-prepare: error: the byte tokenizer has no chat template")
    assert err.count("\n") == 1


def test_the_command_takes_messages_key_and_chat_template(tmp_path, toks, capsys):
    (tmp_path / "t.jinja").write_text(CHATML)
    write_jsonl(tmp_path / "src" / "a.jsonl", [{"conv": CHAT[0]["messages"]}])
    assert main(["--src", str(tmp_path / "src"), "--glob", "*.jsonl", "--out",
                 str(tmp_path / "out" / "c"), "--tokenizer", str(toks["none"]),
                 "--messages-key", "conv", "--chat-template", str(tmp_path / "t.jinja"),
                 "--val-fraction", "0", "--quiet"]) == 0
    meta = json.loads((tmp_path / "out" / "c.json").read_text())
    assert meta["chat_template"] == str(tmp_path / "t.jinja") and meta["num_documents"] == 1
    assert "  chat: 1 conversations, template from " in capsys.readouterr().out


def test_a_tokenizer_without_a_template_is_refused_unless_one_is_given(tmp_path, toks):
    from transformers import AutoTokenizer

    _refused(tmp_path, CHAT, "has no chat template, and the corpus holds conversations; give "
             "one with --chat-template FILE", tokenizer=toks["none"])
    (tmp_path / "t.jinja").write_text(CHATML)
    meta = prepare(tmp_path / "src", "*.jsonl", tmp_path / "out" / "c", tokenizer=toks["none"],
                   chat_template=tmp_path / "t.jinja", val_fraction=0, **_quiet())
    assert meta["chat_template"] == str(tmp_path / "t.jinja")
    # the saved tokenizer holds the template given, and renders a prompt as a chat model does
    saved = AutoTokenizer.from_pretrained(str(tmp_path / "out" / "c.tokenizer"))
    assert (tmp_path / "out" / "c.tokenizer" / "chat_template.jinja").read_text() == CHATML
    msgs = [{"role": "user", "content": "the cat"}]
    assert saved.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False) == (
        "<|im_start|>user\nthe cat<|im_end|>\n<|im_start|>assistant\n")


def test_a_template_without_an_end_of_turn_token_is_refused(tmp_path, toks):
    (tmp_path / "t.jinja").write_text("{% for m in messages %}{{ m.role }}: {{ m.content }}\n"
                                      "{% endfor %}")
    _refused(tmp_path, CHAT, "writes no special token after an assistant's content",
             tokenizer=toks["chatml"], chat_template=tmp_path / "t.jinja")


def test_a_corpus_mixing_text_and_conversations_is_refused(tmp_path, toks):
    _refused(tmp_path, [*CHAT, {"text": "the cat sat"}], "a.jsonl:2 holds the key 'text' but "
             "the corpus is conversations", tokenizer=toks["chatml"])
    _refused(tmp_path, [{"text": "the cat sat"}, *CHAT], "a.jsonl:2 holds the key 'messages' "
             "but the corpus is text", tokenizer=toks["chatml"])


def test_the_workers_encoder_is_rebuilt_from_the_pickled_tokenizer(toks):
    spec = load_tokenizer(toks["qwen3"])
    convs = [conversation(random.Random(8), 2, think=True)]
    here = encoder_for(spec).encode(convs)
    there = encoder_for(pickle.loads(pickle.dumps(spec))).encode(convs)
    assert all(np.array_equal(a, b) for a, b in zip(here[:3], there[:3]))
    assert here[3] == there[3] == [None] and int(here[2].sum()) > 0


def test_the_template_travels_through_the_run_to_the_export(tmp_path, toks):
    """usp-train copies PREFIX.tokenizer/ (run_records.save_tokenizer, or for a pretrained
    model its TOKENIZER_FILES); usp-export loads RUN/tokenizer and saves it beside the
    model: each copy keeps the chat template given at prepare time."""
    from transformers import AutoTokenizer

    from usp.models.export import _run_tokenizer
    from usp.models.run_records import (
        TOKENIZER_FILES,
        save_tokenizer,
        save_tokenizer_files,
    )

    (tmp_path / "t.jinja").write_text(CHATML)
    write_jsonl(tmp_path / "src" / "a.jsonl", CHAT)
    prepare(tmp_path / "src", "*.jsonl", tmp_path / "c", tokenizer=toks["none"],
            chat_template=tmp_path / "t.jinja", val_fraction=0, **_quiet())
    assert "chat_template.jinja" in TOKENIZER_FILES
    msgs = [{"role": "user", "content": "the cat"}]
    want = AutoTokenizer.from_pretrained(str(tmp_path / "c.tokenizer")).apply_chat_template(
        msgs, add_generation_prompt=True)
    for n, copy in enumerate((save_tokenizer, save_tokenizer_files)):
        run = tmp_path / f"run{n}"
        copy(tmp_path / "c.tokenizer", run)
        tok = _run_tokenizer(run, [])
        tok.save_pretrained(str(tmp_path / f"export{n}"))  # what usp-export writes
        export = AutoTokenizer.from_pretrained(str(tmp_path / f"export{n}"))
        assert export.chat_template == CHATML
        assert export.apply_chat_template(msgs, add_generation_prompt=True) == want
