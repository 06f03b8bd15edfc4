"""``usp.train.validator``: when the trainer validates, how a blend's losses combine, and the
note for sources without a validation split (the collective scoring itself:
``distributed/test_pretraining_ranks.py``, held-out accuracy: ``distributed/test_evaluate.py``)."""

import math
from types import SimpleNamespace

import pytest

import usp.eval.val_loss as va
from usp.config import BlendSource, MemmapData, RecallData
from usp.train.validator import Validator, missing_splits


def _split(windows):
    return SimpleNamespace(eval_windows=windows)


def _validator(splits, every=4, last=10) -> Validator:
    return Validator(splits, every, last, 2, mesh=None, layouts=None)


def test_validates_every_eval_every_steps_and_at_the_last():
    v = _validator([("a", 1.0, _split(4))])
    assert [s for s in range(1, 11) if v.should_validate(s)] == [4, 8, 10]
    assert [s for s in range(1, 11) if _validator(v.splits, every=0).should_validate(s)] == [10]


def test_no_splits_never_validate():
    assert not any(_validator([]).should_validate(s) for s in range(1, 11))


def test_a_blend_logs_each_source_and_their_weighted_mean(monkeypatch):
    losses = {4: 2.0, 6: 3.0}  # by the split's windows
    monkeypatch.setattr(va, "validation_loss", lambda model, split, windows, *a: losses[windows])
    out = _validator([("a", 0.75, _split(4)), ("b", 0.25, _split(6))]).validate("model")
    assert out["val_loss/a"] == 2.0 and out["val_loss/b"] == 3.0
    assert out["val_loss"] == pytest.approx(2.25)
    assert out["val_ppl"] == pytest.approx(math.exp(2.25))
    one = _validator([("a", 1.0, _split(4))]).validate("model")
    assert one == {"val_loss": 2.0, "val_ppl": math.exp(2.0)}  # one source: no per-source key


def test_missing_splits_names_the_sources_without_one():
    blend = MemmapData(blend=[BlendSource(path="web"), BlendSource(path="code")])
    note = missing_splits(blend, [("web", 1.0, _split(4))])
    assert note.startswith("no validation split code.val.bin") and "--val-fraction" in note
    assert missing_splits(blend, [("web", 1.0, None), ("code", 1.0, None)]) is None
    assert missing_splits(RecallData(), []) is None  # scores data.eval_batches instead
