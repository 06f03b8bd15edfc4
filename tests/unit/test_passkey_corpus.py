"""``tools/passkey_corpus``: the training documents it writes, about ``--chars`` long with the
needle at a sentence boundary, or with ``--exact`` exactly ``--chars`` characters built as
``usp-eval``'s case of that length (the needle at any character, the key last), seeded."""

import json
import re

import numpy as np
import pytest

from tools import passkey_corpus
from usp.eval.passkey import FILLER, NEEDLE, QUESTION, ByteTokenizer, filler_haystack, make_case

BYTES = ByteTokenizer()


def _docs(tmp_path, *args):
    assert passkey_corpus.main(["--out", str(tmp_path), *args]) == 0
    return [json.loads(line)["text"] for line in (tmp_path / "passkey.jsonl").open()]


def _key(doc):
    return re.fullmatch(r".* The pass key is (\d+)", doc, re.S).group(1)


def test_exact_documents_are_evals_cases_at_random_depths(tmp_path):
    docs = _docs(tmp_path, "--docs", "200", "--chars", "160", "--exact", "--digits", "3")
    assert len(docs) == 200 and {len(d) for d in docs} == {160}
    depths = []
    for doc in docs:
        key = _key(doc)
        assert len(key) == 3 and key[0] != "0"
        needle = NEEDLE.format(key=key)
        at = doc.index(needle)
        hay = doc[:at] + doc[at + len(needle):-len(QUESTION + " " + key)]
        # the haystack is the filler repeated from its start, cut anywhere: usp-eval's
        assert hay == (FILLER * 3)[:len(hay)]
        rebuilt = make_case(BYTES, 160, at / len(hay), key, filler_haystack(BYTES), 256, None)
        assert BYTES.decode(rebuilt.tokens) == doc
        depths.append(at / len(hay))
    assert min(depths) < 0.1 and max(depths) > 0.9  # the needle goes everywhere
    assert len({round(d, 2) for d in depths}) > 30
    assert len({_key(d) for d in docs}) > 100


def test_documents_are_seeded(tmp_path):
    a = _docs(tmp_path / "a", "--docs", "20", "--chars", "200", "--exact", "--digits", "4")
    b = _docs(tmp_path / "b", "--docs", "20", "--chars", "200", "--exact", "--digits", "4")
    c = _docs(tmp_path / "c", "--docs", "20", "--chars", "200", "--exact", "--digits", "4",
              "--seed", "7")
    assert a == b and a != c


def test_sentence_documents_put_the_needle_between_sentences(tmp_path):
    docs = _docs(tmp_path, "--docs", "50", "--chars", "240", "--digits", "5")
    for doc in docs:
        key = _key(doc)
        assert len(key) == 5 and abs(len(doc) - 240) < 60
        before = doc[:doc.index(NEEDLE.format(key=key).strip())]
        assert before == "" or before.endswith(". ")


def test_too_short_for_the_needle_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        passkey_corpus.main(["--out", str(tmp_path), "--chars", "90", "--exact", "--digits", "3"])
    assert e.value.code == 2
    assert "needs at least 98 characters" in capsys.readouterr().err
    assert not (tmp_path / "passkey.jsonl").exists()
    with pytest.raises(ValueError, match="at least 98"):
        passkey_corpus.exact_document(np.random.default_rng(0), 97, 3)
    assert len(passkey_corpus.exact_document(np.random.default_rng(0), 98, 3)) == 98


def test_prepared_without_eos_each_training_window_is_one_document(tmp_path):
    """What recipes/passkey_tiny_cpu.yaml relies on: ``--exact --chars L`` through
    ``usp-prepare --no-eos`` and read at ``seq_len`` L, window i is document i whole, the key
    its last tokens, as in usp-eval's case of length L."""
    from usp.data.memmap import MemmapTokens
    from usp.data.prepare import prepare

    docs = _docs(tmp_path / "src", "--docs", "30", "--chars", "128", "--exact", "--digits", "2")
    prepare(tmp_path / "src", "*.jsonl", tmp_path / "pk", val_fraction=0.0, no_eos=True,
            log=lambda *a: None)
    data = MemmapTokens(tmp_path / "pk", seq_len=128)
    assert data.num_windows == 29  # the last document has no token after it
    for i in range(data.num_windows):
        window = BYTES.decode(data.tokens[i * 128:(i + 1) * 128].tolist())
        assert window in docs and window.endswith(QUESTION + " " + _key(window))
