"""usp-prepare in one process: inputs, tokenizers, the validation split, bad input, atomicity."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest

from _tokenizers import EOS, bpe, jsonl_corpus, save_dir, texts, word_level
from usp.data import MemmapTokens
from usp.data import prepare as prep
from usp.data import sources
from usp.data.prepare import prepare
from usp.data.sources import in_validation
from usp.data.tokenize import Encoder

pytest.importorskip("tokenizers")


def _quiet(**kw):
    return {"log": lambda line: None, **kw}


def _bin(prefix, dtype=np.uint16) -> np.ndarray:
    return np.fromfile(f"{prefix}.bin", dtype=dtype)


def _docs(prefix) -> list[int]:
    return np.fromfile(f"{prefix}.docs", dtype="<i8").tolist()


@pytest.fixture(scope="module")
def tokdir(tmp_path_factory):
    return save_dir(bpe(), tmp_path_factory.mktemp("tok") / "bpe")


def test_jsonl_with_a_tokenizer_directory(tmp_path, tokdir):
    from transformers import AutoTokenizer

    docs = texts(40)
    src = jsonl_corpus(tmp_path / "src", docs)
    lines = []
    meta = prepare(src, "*.jsonl", tmp_path / "out/c", tokenizer=tokdir, val_fraction=0,
                   **_quiet(log=lines.append))
    tok = AutoTokenizer.from_pretrained(str(tokdir))
    want = [tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for t in docs]
    assert _bin(tmp_path / "out/c").tolist() == [i for ids in want for i in ids]
    assert _docs(tmp_path / "out/c") == np.cumsum([0] + [len(w) for w in want[:-1]]).tolist()
    assert meta["vocab_size"] == len(tok) and meta["eos_id"] == tok.convert_tokens_to_ids(EOS)
    assert meta["dtype"] == "uint16" and meta["num_documents"] == 40
    # the three bad lines counted with file:line, the blank line is no document
    counts = meta["problems"]["counts"]
    assert counts == {"line skipped, not JSON": 1, "line skipped, no key 'text' (--text-key)": 1,
                      "line skipped, 'text' is not a string": 1}
    examples = meta["problems"]["examples"]
    assert examples["line skipped, not JSON"][0].startswith("part-0.jsonl:3 ")
    assert examples["line skipped, no key 'text' (--text-key)"] == ["part-0.jsonl:4 (has ['body'])"]
    assert examples["line skipped, 'text' is not a string"] == ["part-0.jsonl:5 (int)"]
    assert any("part-0.jsonl:3" in line for line in lines)
    # the tokenizer travels with the data, loadable as it was given
    copied = AutoTokenizer.from_pretrained(str(tmp_path / "out/c.tokenizer"))
    assert copied(docs[0])["input_ids"] == tok(docs[0])["input_ids"]
    assert copied.eos_token == EOS and meta["tokenizer_dir"] == "c.tokenizer"
    assert MemmapTokens(tmp_path / "out/c", seq_len=16, documents=True).vocab_size == len(tok)


def test_a_tokenizer_json_file_and_the_eos_rules(tmp_path):
    src = jsonl_corpus(tmp_path / "src", texts(10), bad=False)
    bpe().save(str(tmp_path / "with_eos.json"))
    meta = prepare(src, "*.jsonl", tmp_path / "a", tokenizer=tmp_path / "with_eos.json",
                   val_fraction=0, **_quiet())
    assert meta["eos_id"] == bpe().token_to_id(EOS) and _bin(tmp_path / "a")[-1] == meta["eos_id"]
    bpe(eos=None).save(str(tmp_path / "no_eos.json"))
    with pytest.raises(ValueError, match=r"declares no EOS token.*--eos-token TOKEN.*--no-eos"):
        prepare(src, "*.jsonl", tmp_path / "b", tokenizer=tmp_path / "no_eos.json", **_quiet())
    with pytest.raises(ValueError, match=r"--eos-token 'zz' is not a token of"):
        prepare(src, "*.jsonl", tmp_path / "b", tokenizer=tmp_path / "no_eos.json",
                eos_token="zz", **_quiet())
    assert not list(tmp_path.glob("b*"))
    plain = prepare(src, "*.jsonl", tmp_path / "c", tokenizer=tmp_path / "no_eos.json",
                    no_eos=True, val_fraction=0, **_quiet())
    assert plain["eos_id"] is None and plain["num_documents"] == 10
    named = prepare(src, "*.jsonl", tmp_path / "d", tokenizer=tmp_path / "no_eos.json",
                    eos_token="a", val_fraction=0, **_quiet())
    assert named["num_tokens"] == plain["num_tokens"] + 10  # one EOS per document
    with pytest.raises(ValueError, match=r"tokenizer '.*nowhere' not found.*tokenizer.json"):
        prepare(src, "*.jsonl", tmp_path / "e", tokenizer=tmp_path / "nowhere", **_quiet())


def test_uint32_when_the_vocabulary_does_not_fit_uint16(tmp_path):
    big = word_level(70_000)
    save_dir(big, tmp_path / "tok")
    src = jsonl_corpus(tmp_path / "src", ["w1 w69997 w5", "w65536 w2"], bad=False)
    meta = prepare(src, "*.jsonl", tmp_path / "c", tokenizer=tmp_path / "tok", val_fraction=0,
                   **_quiet())
    assert meta["dtype"] == "uint32" and meta["vocab_size"] == 70_000
    assert _bin(tmp_path / "c", np.uint32).tolist() == [1, 69997, 5, 69999, 65536, 2, 69999]


def test_validation_split_by_document(tmp_path):
    docs = [f"document {i} " + t for i, t in enumerate(texts(400, seed=3))]
    src = jsonl_corpus(tmp_path / "src", docs, bad=False)
    meta = prepare(src, "*.jsonl", tmp_path / "c", val_fraction=0.1, **_quiet())
    idents = [f"part-0.jsonl:{i + 1}" for i in range(200)] + [f"part-1.jsonl:{i + 1}"
                                                              for i in range(200)]
    is_val = [in_validation(x, 0.1) for x in idents]
    assert 20 < sum(is_val) < 60  # about 10% of 400
    want_val = [d for d, v in zip(docs, is_val) if v]
    want_train = [d for d, v in zip(docs, is_val) if not v]

    for prefix, want in ((tmp_path / "c", want_train), (tmp_path / "c.val", want_val)):
        ids = _bin(prefix)
        ends = np.flatnonzero(ids == 256)
        got = [bytes(ids[a:b].astype(np.uint8)).decode()
               for a, b in zip(np.concatenate([[0], ends[:-1] + 1]), ends)]
        assert got == want
        assert _docs(prefix) == np.concatenate([[0], ends[:-1] + 1]).tolist()
    val = json.loads(Path(f"{tmp_path / 'c'}.val.json").read_text())
    assert val["split"] == "validation" and meta["split"] == "train"
    train = json.loads(Path(f"{tmp_path / 'c'}.json").read_text())
    assert train["val"] == {"num_tokens": val["num_tokens"], "num_documents": len(want_val)}
    assert meta["val"]["num_documents"] == len(want_val)  # the returned metadata: the whole
    # the split hangs on the document's name only: more files change no one's side
    (src / "part-2.jsonl").write_text(json.dumps({"text": "late"}) + "\n")
    again = prepare(src, "*.jsonl", tmp_path / "d", val_fraction=0.1, **_quiet())
    assert again["val"]["num_documents"] in (len(want_val), len(want_val) + 1)
    assert _bin(tmp_path / "d.val")[: len(_bin(tmp_path / "c.val"))].tolist() == \
        _bin(tmp_path / "c.val").tolist()


def test_any_file_system_order_gives_the_same_bytes(tmp_path, monkeypatch):
    src = jsonl_corpus(tmp_path / "src", texts(30), bad=True)
    (src / "notes.txt").write_text("a text file is one document\n")
    prepare(src, "*", tmp_path / "a/c", val_fraction=0.2, **_quiet())
    listed = Path.glob
    monkeypatch.setattr(Path, "glob", lambda self, p: reversed(list(listed(self, p))))
    prepare(src, "*", tmp_path / "b/c", val_fraction=0.2, **_quiet())
    for name in ("c.bin", "c.json", "c.docs", "c.val.bin", "c.val.json", "c.val.docs"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()


def test_gzip_parquet_and_long_text_files(tmp_path, monkeypatch):
    import pyarrow as pa
    import pyarrow.parquet as pq

    src = tmp_path / "src"
    src.mkdir()
    with gzip.open(src / "a.jsonl.gz", "wt") as f:
        f.write(json.dumps({"text": "zipped"}) + "\n")
    pq.write_table(pa.table({"text": ["row one", None, "row three"]}), src / "b.parquet")
    pq.write_table(pa.table({"body": ["x", "y"]}), src / "c.parquet")
    long = ("line of text " * 9 + "\n") * 30 + "tail without newline"
    (src / "d.txt").write_text(long)
    monkeypatch.setattr(sources, "PIECE_BYTES", 100)  # d.txt goes in many pieces
    meta = prepare(src, "*", tmp_path / "c", val_fraction=0, **_quiet())
    ids = _bin(tmp_path / "c")
    want = b"zipped\x00row one\x00row three\x00" + long.encode() + b"\x00"
    assert bytes(np.where(ids == 256, 0, ids).astype(np.uint8)) == want
    assert meta["num_documents"] == 4  # one per text, the long file still one document
    assert meta["problems"]["counts"] == {"row skipped, 'text' is not a string": 1,
                                          "rows skipped, no column 'text' (--text-key)": 2}
    assert meta["problems"]["examples"]["row skipped, 'text' is not a string"] == \
        ["b.parquet:2 (NoneType)"]


def test_max_bytes_and_raw_text_files(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_bytes(bytes(range(256)))  # not UTF-8: the byte tokenizer keeps it
    (src / "b.txt").write_bytes(b"hello world")
    full = prepare(src, "*.txt", tmp_path / "full", val_fraction=0, **_quiet())
    assert _bin(tmp_path / "full").tolist() == list(range(256)) + [256] + list(b"hello world") \
        + [256]
    assert full["problems"]["counts"] == {}
    capped = prepare(src, "*.txt", tmp_path / "cap", max_bytes=260, val_fraction=0, **_quiet())
    assert capped["num_tokens"] == 256 + 1 + 4 + 1 and capped["source"]["num_bytes"] == 260


def test_bad_input_leaves_nothing_written(tmp_path, tokdir):
    src = jsonl_corpus(tmp_path / "src", texts(12), bad=True)
    out = tmp_path / "out" / "c"
    with pytest.raises(ValueError, match=r"part-0.jsonl:3: line skipped, not JSON.*--strict"):
        prepare(src, "*.jsonl", out, strict=True, **_quiet())
    # a wrong --text-key: no line has it, no document, one error naming the key
    with pytest.raises(ValueError, match=r"no documents in the 2 files.*no key 'content'.*"
                                         r"check --glob and --text-key"):
        prepare(src, "*.jsonl", out, text_key="content", **_quiet())
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "e.jsonl").write_text("\n\n")
    with pytest.raises(ValueError, match=r"no documents in the 1 files"):
        prepare(tmp_path / "empty", "*.jsonl", out, **_quiet())
    for bad, pattern in (({"val_fraction": 1.0}, r"val_fraction=1.0 must lie in \[0, 1\)"),
                         ({"workers": 0}, r"workers=0 must be >= 1")):
        with pytest.raises(ValueError, match=pattern):
            prepare(src, "*.jsonl", out, **_quiet(**bad))
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").iterdir())


def test_an_interrupted_run_keeps_the_previous_output(tmp_path, tokdir, monkeypatch):
    src = jsonl_corpus(tmp_path / "src", texts(300), bad=False)
    out = tmp_path / "c"
    prepare(src, "*.jsonl", out, tokenizer=tokdir, val_fraction=0.1, **_quiet())
    before = {p.name: p.read_bytes() for p in tmp_path.glob("c*") if p.is_file()}
    calls = []

    def interrupted(self, texts_):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(self, texts_)

    real = Encoder.encode
    monkeypatch.setattr(prep, "TASK_PIECES", 50)  # several tasks, the second one interrupted
    monkeypatch.setattr(Encoder, "encode", interrupted)
    with pytest.raises(KeyboardInterrupt):
        prepare(src, "*.jsonl", out, val_fraction=0.1, **_quiet())  # bytes this time
    after = {p.name: p.read_bytes() for p in tmp_path.glob("c*") if p.is_file()}
    assert after == before and len(calls) == 2
    assert (tmp_path / "c.tokenizer" / "tokenizer.json").is_file()
    assert not list(tmp_path.rglob("*.tmp"))
    # a finished byte-level run replaces the lot: no stale tokenizer, no stale split
    monkeypatch.setattr(Encoder, "encode", real)
    prepare(src, "*.jsonl", out, val_fraction=0, **_quiet())
    assert not (tmp_path / "c.tokenizer").exists() and not (tmp_path / "c.val.bin").exists()
    assert json.loads((tmp_path / "c.json").read_text())["tokenizer"] == "bytes+eos"


def test_unreadable_files_and_unencodable_lines(tmp_path):
    import shutil as sh

    src = tmp_path / "src"
    src.mkdir()
    (src / "a.jsonl").write_text('{"text": "fine"}\n{"text": "broken emoji \\ud83d here"}\n')
    meta = prepare(src, "*.jsonl", tmp_path / "c", val_fraction=0, **_quiet())
    assert meta["num_documents"] == 1
    assert meta["problems"]["counts"] == {"line skipped, text not encodable as UTF-8": 1}
    assert meta["problems"]["examples"]["line skipped, text not encodable as UTF-8"][0] \
        .startswith("a.jsonl:2 (surrogates not allowed")
    with gzip.open(src / "b.jsonl.gz", "wt") as f:
        f.write(json.dumps({"text": "x" * 5000}) + "\n")
    data = (src / "b.jsonl.gz").read_bytes()
    (src / "b.jsonl.gz").write_bytes(data[: len(data) // 2])  # truncated
    with pytest.raises(ValueError, match=r"b.jsonl.gz cannot be read \(EOFError"):
        prepare(src, "*", tmp_path / "d", **_quiet())
    (src / "b.jsonl.gz").unlink()
    (src / "c.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(ValueError, match=r"c.parquet cannot be read as Parquet"):
        prepare(src, "*", tmp_path / "d", **_quiet())
    assert not list(tmp_path.glob("d*"))
    sh.rmtree(src)


def test_blends_compare_tokenizers_by_content_not_path(tmp_path):
    from usp.config import BlendSource, MemmapData
    from usp.data.dataset import data_vocab

    src = jsonl_corpus(tmp_path / "src", texts(20), bad=False)
    bpe().save(str(tmp_path / "tok.json"))
    (tmp_path / "copy.json").write_bytes((tmp_path / "tok.json").read_bytes())
    bpe(vocab_size=280).save(str(tmp_path / "other.json"))
    for name, tok in (("a", "tok.json"), ("b", "copy.json"), ("c", "other.json")):
        prepare(src, "*.jsonl", tmp_path / name, tokenizer=tmp_path / tok, val_fraction=0,
                **_quiet())

    def blend(*names):
        return MemmapData(blend=[BlendSource(path=str(tmp_path / n)) for n in names])

    assert data_vocab(blend("a", "b")) == json.loads((tmp_path / "a.json").read_text())[
        "vocab_size"]  # the same tokenizer from two paths
    with pytest.raises(ValueError, match=r"mixes token files of different tokenizers"):
        data_vocab(blend("a", "c"))
