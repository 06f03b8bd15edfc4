"""``usp.train.checkpointer.Checkpointer``: which steps end with a checkpoint, what a save
records, what a resume returns; the collective save/load are stand-ins here (the files
themselves: ``distributed/test_checkpoint_files.py``, resumes: ``distributed/test_train.py``)."""

from pathlib import Path
from types import SimpleNamespace

import pytest

import usp.train.checkpointer as ckr
from usp.config import TrainerConfig
from usp.train.checkpointer import Checkpointer, Position

def _checkpointer(rank=0, run_dir="run", **trainer) -> Checkpointer:
    run = SimpleNamespace(global_batch=8, dp=2, grad_accum=2, batch_per_dp_rank=2,
                          run_dir=run_dir)  # the layout's run directory, not the config's
    return Checkpointer(TrainerConfig(**{"steps": 10, **trainer}), run, {"model.dim": 64}, rank)


def test_saves_every_ckpt_every_steps_at_stop_after_and_at_the_last():
    c = _checkpointer(ckpt_every=3, stop_after=5)
    assert [s for s in range(1, 11) if c.should_save(s)] == [3, 5, 6, 9, 10]
    assert c.should_save(4, preempted=True)


def test_ckpt_every_zero_saves_only_the_last_and_a_preempted_step():
    c = _checkpointer(ckpt_every=0)
    assert [s for s in range(1, 11) if c.should_save(s)] == [10]
    assert c.should_save(2, preempted=True)


def test_save_records_the_data_position_and_the_fingerprint(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(ckr, "save_checkpoint",
                        lambda *a, **kw: calls.append((a, kw)) or Path("step_000004"))
    c = _checkpointer(run_dir=str(tmp_path), keep_checkpoints=3)
    assert c.save(4, "model", "opt", "sched", Position(4, 32, 1)) == Path("step_000004")
    (args, kw), = calls
    assert args == (tmp_path, 4, "model", "opt", "sched")
    assert kw == {"keep": 3, "extra": {"skipped_steps": 1, "consumed": 32, "global_batch": 8},
                  "fingerprint": {"model.dim": 64}}


def test_load_without_resume_looks_for_nothing(monkeypatch):
    monkeypatch.setattr(ckr, "choose_checkpoint", lambda d: pytest.fail("looked"))
    assert _checkpointer(resume=False).load("model", "opt", "sched") == Position()


def test_load_returns_the_checkpoints_position(monkeypatch, capsys):
    monkeypatch.setattr(ckr, "choose_checkpoint", lambda d: Path("step_000006"))
    extra = {"step": 6, "consumed": 40, "skipped_steps": 2, "global_batch": 4,
             "rng_restored": True}
    seen = {}

    def load(path, model, opt, sched, fingerprint):
        seen.update(path=path, fingerprint=fingerprint)
        return extra

    monkeypatch.setattr(ckr, "load_checkpoint", load)
    assert _checkpointer(resume=True).load("model", "opt", "sched") == Position(6, 40, 2)
    assert seen == {"path": Path("step_000006"), "fingerprint": {"model.dim": 64}}
    out = capsys.readouterr().out
    assert "resumed from step_000006 at step 6 (40 samples consumed)" in out
    assert "global batch changed from 4 to 8" in out


def test_load_of_an_older_checkpoint_counts_steps_and_reseeds(monkeypatch, capsys):
    """No ``consumed`` (before the data position): steps x global batch; no RNG state:
    the seed from step and rank."""
    monkeypatch.setattr(ckr, "choose_checkpoint", lambda d: Path("step_000003"))
    monkeypatch.setattr(ckr, "load_checkpoint",
                        lambda *a, **kw: {"step": 3, "rng_restored": False})
    seeds = []
    monkeypatch.setattr(ckr.torch, "manual_seed", seeds.append)
    at = _checkpointer(rank=1, resume=True, seed=7).load("model", "opt", "sched")
    assert at == Position(3, 24, 0) and seeds == [7 + 3000 + 1]
    assert capsys.readouterr().out == ""  # rank 1 prints nothing
