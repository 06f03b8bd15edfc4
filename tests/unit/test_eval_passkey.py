"""``usp.eval``'s pure half: passkey cases (exact length, the needle at its depth, the key
last, seeded), their scoring, loss-by-position buckets; and ``usp-eval``'s bad inputs, each
one ValueError from ``plan_eval``/``resolve_eval`` before any process group (the runs
themselves: ``distributed/test_eval_ranks.py``)."""

import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from usp.config import EvalConfig, MemmapData, RecallData
from usp.eval.passkey import (NEEDLE, QUESTION, ByteTokenizer, answer_ids, case_labels,
                                 passkey_cases, score, text_haystack)
from usp.eval.job import plan_eval
from usp.eval.grid import data_path
from usp.run import resolve_eval
from usp.eval.position import bucket_edges, bucket_losses
from usp.eval.results import passkey_lines, passkey_result
from usp.models.run_records import save_data_record, save_model_config

from _eval_runs import MODEL, byte_corpus, run_cfg

BYTES = ByteTokenizer()


def _cases(seed=0, **kw):
    args = dict(lengths=[200, 300], depths=[0.0, 0.5, 1.0], per_cell=3, key_digits=5,
                seed=seed, vocab_size=257)
    return passkey_cases(BYTES, **{**args, **kw})


def test_cases_hold_the_needle_at_its_depth_and_the_key_last():
    cases = _cases()
    assert len(cases) == 2 * 3 * 3
    for c in cases:
        assert len(c.tokens) == c.length and c.key_len == 5 and len(c.key) == 5
        text = BYTES.decode(c.tokens)
        needle = NEEDLE.format(key=c.key)
        assert text.endswith(QUESTION + " " + c.key)
        assert BYTES.decode(c.tokens[c.needle_at:c.needle_at + len(needle)]) == needle
        hay = c.length - len(needle) - len(QUESTION) - 6  # " " + 5 digits
        assert c.needle_at == round(c.depth * hay)
    assert cases[0].needle_at == 0 and cases[6].needle_at > cases[3].needle_at > 0


def test_cases_are_seeded():
    assert _cases() == _cases()
    assert [c.key for c in _cases()] != [c.key for c in _cases(seed=1)]
    # a cell's keys do not depend on which other cells are scored
    alone = passkey_cases(BYTES, [300], [1.0], 3, 5, 0, 257)
    assert [c.key for c in alone] == [c.key for c in _cases() if c.length == 300 and c.depth == 1.0]
    assert len({c.key for c in _cases()}) > 10


def test_text_haystack_and_its_shortage():
    text = np.arange(10, 250, dtype=np.int64)
    cases = _cases(haystack=text_haystack(text), lengths=[200])
    assert all(set(c.tokens[:c.needle_at]) <= set(text.tolist()) for c in cases)
    with pytest.raises(ValueError, match="holds 240"):
        _cases(haystack=text_haystack(text), lengths=[400])


def test_score_is_exact_match_of_every_key_token():
    case = _cases()[0]
    labels = case_labels(case)
    rows = [t for t, y in enumerate(labels) if y != -100]
    assert rows == list(range(case.length - 6, case.length - 1))
    preds = [0] * case.length
    for t in rows:
        preds[t] = case.tokens[t + 1]
    losses = [0.0] * case.length
    losses[rows[0]] = 2.5
    s = score(case, losses, preds)
    assert s["passed"] and s["key_logprob"] == pytest.approx(-0.5)
    preds[rows[-1]] += 1
    assert not score(case, losses, preds)["passed"]
    result = passkey_result([s], [case.length], [case.depth], case.length, 5)
    assert result["accuracy"] == [[1.0]] and "teacher-forced" in result["scoring"]
    assert passkey_lines(result)[0].startswith(f"passkey L={case.length}: accuracy 1.000")


def test_one_digit_keys_are_scored_and_their_chance_is_one_in_nine():
    cases = passkey_cases(BYTES, [128], [0.0, 0.5, 1.0], 3, 1, 0, 257)
    assert all(c.key_len == 1 and c.key in "123456789" for c in cases)
    assert all(bytes(c.tokens[-2:]) == b" " + c.key.encode() for c in cases)
    labels = case_labels(cases[0])
    assert [y for y in labels if y != -100] == [ord(cases[0].key)]
    assert passkey_result([], [128], [0.0], 128, 1)["chance"] == pytest.approx(1 / 9)
    assert passkey_result([], [128], [0.0], 128, 2)["chance"] == pytest.approx(1 / 90)


def test_position_buckets_weighted_by_tokens():
    assert bucket_edges(10, 4) == [0, 2, 5, 7, 10]
    assert bucket_edges(3, 16) == [0, 1, 2, 3]
    out = bucket_losses([1.0, 3.0, 6.0, 0.0], [1, 1, 2, 0], 2)
    assert out[0] == 2.0 and out[1] == 3.0
    assert math.isnan(bucket_losses([0.0, 0.0], [0, 0], 1)[0])


def test_a_key_the_tokenizer_cannot_encode():
    with pytest.raises(ValueError, match="cannot encode the key '12345'"):
        answer_ids(BYTES, "12345", vocab_size=40)  # the digits' bytes are past the vocabulary
    assert answer_ids(BYTES, "12345", 257) == (list(b" 12345"), 5)  # the space is not scored


def test_bad_depth_is_refused_by_the_config():
    with pytest.raises(ValueError, match=r"eval.depths has \[1.5\] outside \[0, 1\]"):
        EvalConfig(depths=[0.0, 1.5])


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return byte_corpus(tmp_path_factory.mktemp("eval") / "bytes")


def test_plan_from_the_data_uses_its_byte_tokenizer_and_text(corpus, tmp_path):
    job = plan_eval(replace(run_cfg(tmp_path, corpus), eval=EvalConfig(
        lengths=[128], depths=[0.5], per_cell=1, key_digits=3, windows=3)), out=str(tmp_path))
    assert [c.length for c in job.cases] == [128] and job.windows[128].shape == (3, 129)
    assert job.out == tmp_path and job.train_len == 128 and job.checkpoint is None
    assert "validation text" in job.notes[0]


def test_the_data_scored_is_data_path_else_the_runs_record():
    """A recipe's ``data=memmap`` without files (``eval.run_dir=RUN recipe=passkey_tiny_cpu``)
    reads the run's recorded files; a data.path given overrides the record."""
    record = {"kind": "memmap", "path": "/runs/data/pk"}
    cfg = run_cfg(Path("/runs/r"), Path("/given/pk"))
    assert data_path(cfg, record) == "/given/pk"
    bare = replace(cfg, data=MemmapData(seq_len=128))
    assert data_path(bare, record) == "/runs/data/pk"
    with pytest.raises(ValueError, match="data.path is not set"):
        data_path(bare, None)
    assert data_path(replace(cfg, data=RecallData()), record) == "/runs/data/pk"


def test_bad_inputs_each_one_error(corpus, tmp_path):
    cfg = run_cfg(tmp_path / "run", corpus)
    with pytest.raises(ValueError, match="validation split holds 3000 tokens"):
        plan_eval(replace(cfg, eval=replace(cfg.eval, lengths=[4096], passkey=False)))
    with pytest.raises(ValueError, match="holds 3000"):  # the passkey haystack, too
        plan_eval(replace(cfg, eval=replace(cfg.eval, lengths=[4096])))
    with pytest.raises(ValueError, match="not divisible by 2 x ring x ulysses = 8"):
        resolve_eval(replace(cfg, parallel=replace(cfg.parallel, ring_degree=4)), 4, "cpu",
                    [128, 132])
    run = tmp_path / "run"
    with pytest.raises(ValueError, match="is not a directory"):
        plan_eval(replace(cfg, eval=replace(cfg.eval, run_dir=str(run))))
    save_model_config(MODEL, run)
    save_data_record(cfg.data, run, None)
    with pytest.raises(ValueError, match="no checkpoint to score"):
        plan_eval(replace(cfg, eval=replace(cfg.eval, run_dir=str(run))))
    recall = tmp_path / "recall"
    save_data_record(RecallData(), recall, None)
    with pytest.raises(ValueError, match="synthetic recall task"):
        plan_eval(replace(cfg, eval=replace(cfg.eval, run_dir=str(recall))))
    with pytest.raises(ValueError, match="synthetic recall task"):
        plan_eval(replace(cfg, data=RecallData()))




def test_a_checkpoint_is_scored_with_its_own_phases_model_and_length(corpus, tmp_path):
    """A run of length phases: the run directory's records are the last phase's (RoPE base
    40000, 512 tokens); a checkpoint of the first phase keeps its own (10000, 128), and
    ``eval.run_dir`` may name it; the results still go to the run directory."""
    import json

    from usp.models.checkpoint import MANIFEST

    run = tmp_path / "run"
    cfg = run_cfg(run, corpus)
    long = replace(MODEL, rope_theta=40000.0)
    save_model_config(long, run)
    save_data_record(replace(cfg.data, seq_len=512), run, None)
    steps = {}
    for step, mc, seq_len in ((700, MODEL, 128), (900, long, 512)):
        d = steps[step] = run / "checkpoints" / f"step_{step:06d}"
        d.mkdir(parents=True)
        (d / ".metadata").write_bytes(b"")
        (d / MANIFEST).write_text(json.dumps({"step": step, "files": {}}))
        save_model_config(mc, d)
        save_data_record(replace(cfg.data, seq_len=seq_len), d, None)
    grid = EvalConfig(lengths=[128], depths=[0.5], per_cell=1, key_digits=3, windows=1)
    job = plan_eval(replace(cfg, eval=replace(grid, run_dir=str(steps[700]))))
    assert (job.checkpoint, job.out) == (steps[700], run)
    assert (job.cfg.model.rope_theta, job.train_len) == (MODEL.rope_theta, 128)
    newest = plan_eval(replace(cfg, eval=replace(grid, run_dir=str(run))))
    assert newest.checkpoint == steps[900]
    assert (newest.cfg.model.rope_theta, newest.train_len) == (40000.0, 512)
