"""``usp.train.checkpointer.Checkpointer``: which steps end with a checkpoint, what a save
records, what a resume returns; the collective save/load are stand-ins here (the files
themselves: ``distributed/test_checkpoint_files.py``, resumes: ``distributed/test_train.py``)."""

from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

import usp.train.checkpointer as ckr
from usp.config import TrainerConfig
from usp.train.checkpointer import Checkpointer, Position
from usp.train.phase_runner import PhasePosition

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


def test_a_trainer_saves_at_its_end_and_where_its_stop_ends_it():
    c = Checkpointer(TrainerConfig(steps=10, ckpt_every=0),
                     SimpleNamespace(global_batch=8, run_dir="run"), {}, 0, end=4)
    assert [s for s in range(1, 11) if c.should_save(s)] == [4]
    assert c.should_save(2, ends=True)


def test_save_records_the_data_position_and_the_fingerprint(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(ckr, "save_checkpoint",
                        lambda *a, **kw: calls.append((a, kw)) or Path("step_000004"))
    c = _checkpointer(run_dir=str(tmp_path), keep_checkpoints=3)
    at = PhasePosition(4, 32, 1)  # the runner's record beside the trainer's position
    assert c.save(4, "model", "opt", "sched", at.trainer, at.record()) == Path("step_000004")
    (args, kw), = calls
    assert args == (tmp_path, 4, "model", "opt", "sched")
    assert kw == {"keep": 3, "extra": {"skipped_steps": 1, "consumed": 32, "global_batch": 8,
                                       "phase": 0, "starts": [0], "tokens_before": 0,
                                       "reference_val_loss": None},
                  "fingerprint": {"model.dim": 64}, "records": None}


def test_a_boundary_checkpoint_leaves_the_batch_to_the_next_phase(monkeypatch, tmp_path):
    """Saved at a phase boundary, the position is the next phase's (nothing consumed): its
    batch is that phase's to say, so a resume into it says no "global batch changed"."""
    calls = []
    monkeypatch.setattr(ckr, "save_checkpoint",
                        lambda *a, **kw: calls.append(kw) or Path("step_000004"))
    c = _checkpointer(run_dir=str(tmp_path))
    for at in (PhasePosition(4, 0, 0, 1, (0, 4), 128), PhasePosition(6, 8, 0, 1, (0, 4), 128)):
        c.save(at.step, "model", "opt", "sched", at.trainer, at.record())
    assert [kw["extra"]["global_batch"] for kw in calls] == [None, 8]


def test_a_boundary_hands_on_the_next_phases_position():
    at = PhasePosition(step=5, consumed=40, skipped=1, phase=0, starts=(0,), reference=2.5)
    assert at.tokens_seen(128) == 40 * 128
    after = at.next_phase(128)
    assert after == PhasePosition(5, 0, 1, 1, (0, 5), 40 * 128, 2.5)
    assert replace(after, consumed=8).tokens_seen(256) == 40 * 128 + 8 * 256
    # what a checkpoint records reads back as the same position
    assert PhasePosition.of({"step": 5, **after.record()}, 8) == after
    assert after.trainer == Position(5, 0, 1)


def test_newest_without_resume_looks_for_nothing(monkeypatch):
    monkeypatch.setattr(ckr, "choose_checkpoint", lambda d: pytest.fail("looked"))
    assert ckr.newest(TrainerConfig(resume=False), "run", {}) == (None, {})


def _write_ckpt(path, extra, fingerprint):
    import json

    import torch

    path.mkdir(parents=True)
    torch.save(extra, path / "extra.pt")
    (path / "manifest.json").write_text(json.dumps({"fingerprint": fingerprint, "files": {}}))
    return path


def test_newest_reads_the_phase_before_anything_is_built(monkeypatch, tmp_path):
    extra = {"step": 6, "consumed": 0, "skipped_steps": 2, "phase": 2, "starts": [0, 3, 5],
             "tokens_before": 999, "reference_val_loss": 1.5, "scheduler": {}}
    ckpt = _write_ckpt(tmp_path / "step_000006", extra, {"model.dim": 64})
    monkeypatch.setattr(ckr, "choose_checkpoint", lambda d: ckpt)
    found, record = ckr.newest(TrainerConfig(resume=True), "run", {"model.dim": 64})
    assert (found, PhasePosition.of(record, 8)) == (
        ckpt, PhasePosition(6, 0, 2, 2, (0, 3, 5), 999, 1.5))
    with pytest.raises(ValueError, match="model.dim: 64 -> 32"):  # before anything is built
        ckr.newest(TrainerConfig(resume=True), "run", {"model.dim": 32})


def test_newest_of_an_older_checkpoint_counts_steps_in_phase_zero(monkeypatch, tmp_path):
    """No ``consumed`` (before the data position): steps x global batch; no phase: 0."""
    ckpt = _write_ckpt(tmp_path / "step_000003", {"step": 3}, {})
    monkeypatch.setattr(ckr, "choose_checkpoint", lambda d: ckpt)
    found, record = ckr.newest(TrainerConfig(resume=True), "run", {})
    assert (found, PhasePosition.of(record, 8)) == (ckpt, PhasePosition(3, 24, 0))


def test_load_reports_the_checkpoints_position(monkeypatch, capsys):
    extra = {"step": 6, "consumed": 40, "skipped_steps": 2, "global_batch": 4,
             "rng_restored": True}
    seen = {}

    def load(path, model, opt, sched, fingerprint):
        seen.update(path=path, fingerprint=fingerprint)
        return extra

    monkeypatch.setattr(ckr, "load_checkpoint", load)
    _checkpointer().load(Path("step_000006"), "model", "opt", "sched")
    assert seen == {"path": Path("step_000006"), "fingerprint": {"model.dim": 64}}
    out = capsys.readouterr().out
    assert "resumed from step_000006 at step 6 (40 samples consumed)" in out
    assert "global batch changed from 4 to 8" in out
    _checkpointer().load(Path("step_000006"), "model", "opt", "sched", report=False)
    assert capsys.readouterr().out == ""  # a phase boundary: the phase's line says it
    _checkpointer().load(None, "model", "opt", "sched")  # a fresh start: nothing loaded


def test_load_without_rng_state_reseeds(monkeypatch, capsys):
    monkeypatch.setattr(ckr, "load_checkpoint",
                        lambda *a, **kw: {"step": 3, "rng_restored": False})
    seeds = []
    monkeypatch.setattr(ckr.torch, "manual_seed", seeds.append)
    _checkpointer(rank=1, seed=7).load(Path("step_000003"), "model", "opt", "sched")
    assert seeds == [7 + 3000 + 1]
    assert capsys.readouterr().out == ""  # rank 1 prints nothing
