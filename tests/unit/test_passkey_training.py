"""``eval.during_training``'s wiring, without a process group: the metrics a passkey result
gives (``passkey_acc/<L>``, ``passkey_logprob/<L>``), the Validator that validates with a
passkey score alone and hands its dict back with the validation loss, the console line it
gets, the grid the trainer scores (the one usp-eval scores), and the preflight's refusals
(the collective scoring: ``distributed/test_passkey_training_ranks.py``)."""

from dataclasses import replace
from types import SimpleNamespace

import pytest

import usp.eval.val_loss as va
from usp.config import RecallData
from usp.eval.job import plan_eval
from usp.run import check_degrees_fit, check_inputs
from usp.eval.grid import training_cases
from usp.eval.results import passkey_metrics, passkey_result
from usp.train.console import Console
from usp.train.validator import Validator

from _eval_runs import byte_corpus, run_cfg


def _case(length, depth, passed, logprob):
    return {"length": length, "depth": depth, "key": "123", "passed": passed,
            "key_logprob": logprob}


def test_metrics_are_each_lengths_pass_rate_and_mean_log_likelihood():
    cases = [_case(64, 0.0, True, -1.0), _case(64, 1.0, False, -3.0), _case(64, 1.0, True, -2.0),
             _case(128, 0.0, False, -4.0)]
    result = passkey_result(cases, [64, 128], [0.0, 1.0], 64, 3)
    assert passkey_metrics(result) == {"passkey_acc/64": 2 / 3, "passkey_logprob/64": -2.0,
                                       "passkey_acc/128": 0.0, "passkey_logprob/128": -4.0}


def test_the_heatmap_writes_what_passkey_json_holds():
    """3 of 4 is 0.75 in passkey.json and "3/4" in its cell (one decimal rounded half to
    even printed "0.8"); the title says the step, the cases a cell and chance."""
    from usp.eval.results import cell_text, passkey_title

    cases = [_case(64, d, p, -1.0) for d in (0.0, 1.0) for p in (True, False, True, True)]
    cases[4:6] = [_case(64, 1.0, False, -1.0)] * 2  # depth 1: 2 of 4 passed
    result = passkey_result(cases, [64, 128], [0.0, 1.0], 64, 1, step=700)
    assert result["accuracy"][0] == [0.75, 0.5] and result["step"] == 700
    assert [cell_text(result, 0, j) for j in (0, 1)] == ["3/4", "2/4"]
    assert cell_text(result, 1, 0) == "-"  # no case at 128
    assert passkey_title(result).startswith("passkey retrieval at step 700: 4 cases a cell, "
                                            "1-digit keys, chance 0.111")


class _Score:
    def __init__(self):
        self.calls = 0

    def score(self, model, step=None):
        self.calls += 1
        return {"passkey_acc/64": 0.5}


def test_a_passkey_score_alone_validates_on_the_schedule_and_joins_the_val_loss(monkeypatch):
    pk = _Score()
    v = Validator([], 4, 10, 2, mesh=None, layouts=None, passkey=pk)
    assert [s for s in range(0, 11) if v.should_validate(s)] == [0, 4, 8, 10]
    assert v.validate("model") == {"passkey_acc/64": 0.5}
    monkeypatch.setattr(va, "validation_loss", lambda *a: 2.0)
    split = SimpleNamespace(eval_windows=4)
    both = Validator([("a", 1.0, split)], 4, 10, 2, mesh=None, layouts=None,
                     passkey=pk).validate("model")
    assert both["val_loss"] == 2.0 and both["passkey_acc/64"] == 0.5 and pk.calls == 2


def test_a_passkey_record_gets_a_console_line(capsys):
    Console(0, 0, False, 10, 0).log({"step": 3, "loss": 1.0, "passkey_acc/64": 0.5})
    assert "passkey_acc/64=0.5" in capsys.readouterr().out


@pytest.fixture
def cfg(tmp_path):
    c = run_cfg(tmp_path / "run", byte_corpus(tmp_path / "bytes"), u=1, r=2)
    return replace(c, eval=replace(c.eval, during_training=True))


def test_the_trainer_scores_the_grid_usp_eval_scores(cfg):
    cases = training_cases(cfg, cfg.data.seq_len)
    assert cases == plan_eval(cfg).cases and {c.length for c in cases} == {128, 256}
    default = replace(cfg, eval=replace(cfg.eval, lengths=[]))
    assert {c.length for c in training_cases(default, 128)} == {128}  # the training length


def test_preflight_refuses_a_length_the_training_layout_cannot_split(cfg):
    check_degrees_fit(cfg, 1, 2)
    bad = replace(cfg, eval=replace(cfg.eval, lengths=[128, 250]))
    with pytest.raises(ValueError, match=r"eval.during_training=true scores eval.lengths=\[128, "
                       r"250\] on the training layout: sequence length 250 is not divisible by "
                       r"2 x ring x ulysses = 4 .*use seq_len 248 or 252"):
        check_degrees_fit(bad, 1, 2)
    off = replace(bad, eval=replace(bad.eval, during_training=False))
    check_degrees_fit(off, 1, 2)  # usp-eval's lengths are not the trainer's business


def test_preflight_refuses_a_grid_it_cannot_write(cfg):
    check_inputs(cfg, "cpu", None)
    with pytest.raises(ValueError, match="data.kind=recall .* has no text"):
        check_inputs(replace(cfg, data=RecallData()), "cpu", None)
    long = replace(cfg, eval=replace(cfg.eval, lengths=[128, 4096], haystack="text"))
    with pytest.raises(ValueError, match=r"eval.during_training=true: a passkey case needs "
                       r"\d+ haystack tokens but the validation split holds 3000"):
        check_inputs(long, "cpu", None)
