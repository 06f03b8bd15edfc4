"""Passkey during training (``eval.during_training=true``) on 2 gloo ranks, a tiny byte-token
memmap run: ``passkey_acc/<L>`` and ``passkey_logprob/<L>`` are in the metrics.jsonl records
of every validation (step 0, each ``trainer.eval_every``, the last), the same on every rank,
and the last ones equal what usp-eval computes from the run's last checkpoint (pass/fail
case by case, log-likelihoods within 1e-5); the run directory holds the last passkey.json
and passkey.png; and the training losses are those of the same run without it."""

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch.distributed as dist

from usp.eval.command import _worker
from usp.eval.job import plan_eval
from usp.launch import spawn_local
from usp.run import resolve_eval
from usp.train.phase_runner import train

from _eval_runs import byte_corpus, run_cfg


def _records(run_dir):
    return [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _train_keep(cfg) -> None:
    """``train(cfg)`` on this rank; its returned summary to ``run_dir/rank<r>.json``."""
    summary = train(cfg)
    path = Path(cfg.trainer.run_dir) / f"rank{dist.get_rank()}.json"
    path.write_text(json.dumps(summary))


def _trained(cfg) -> list[dict]:
    """Every rank's summary of ``train(cfg)`` on 2 ranks."""
    spawn_local(_train_keep, 2, cfg)
    return [json.loads((Path(cfg.trainer.run_dir) / f"rank{r}.json").read_text())
            for r in range(2)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("pktrain")
    prefix = byte_corpus(root / "bytes")
    base = run_cfg(root / "plain", prefix, u=1, r=2, steps=3)
    base = replace(base, trainer=replace(base.trainer, eval_every=2))
    scored = replace(base, trainer=replace(base.trainer, run_dir=str(root / "scored")),
                     eval=replace(base.eval, during_training=True))
    _trained(base)
    summaries = _trained(scored)
    return root, scored, summaries


def test_passkey_scores_in_the_metrics_at_every_validation_and_the_losses_unchanged(runs):
    root, cfg, summaries = runs
    plain, scored = _records(root / "plain"), _records(root / "scored")
    keys = ["passkey_acc/128", "passkey_logprob/128", "passkey_acc/256", "passkey_logprob/256"]
    assert [r["step"] for r in scored if keys[0] in r] == [0, 2, 3]
    assert not any(k.startswith("passkey") for r in plain for k in r)
    for r in scored:
        if keys[0] in r:
            assert all(k in r for k in keys) and "val_loss" in r
            assert 0.0 <= r["passkey_acc/128"] <= 1.0 and r["passkey_logprob/256"] < 0.0
    # enabling it changes no training loss (nor validation loss)
    assert [r.get("loss") for r in scored] == [r.get("loss") for r in plain]
    assert [r.get("val_loss") for r in scored] == [r.get("val_loss") for r in plain]
    # every rank returned the same last scores (rank 0's)
    assert summaries[0][keys[1]] == summaries[1][keys[1]] == scored[-1][keys[1]]
    assert (root / "scored" / "passkey.png").stat().st_size > 0


def test_the_last_scores_are_what_usp_eval_computes_on_the_last_checkpoint(runs):
    root, cfg, _ = runs
    last = _records(root / "scored")[-1]
    trained = json.loads((root / "scored" / "passkey.json").read_text())
    job = plan_eval(replace(cfg, eval=replace(cfg.eval, run_dir=str(root / "scored"),
                                               out=str(root / "eval"), position_loss=False)))
    spawn_local(_worker, 2, job, resolve_eval(job.cfg, 2, "cpu", job.lengths))
    evaluated = json.loads((root / "eval" / "passkey.json").read_text())
    assert [c["key"] for c in trained["cases"]] == [c["key"] for c in evaluated["cases"]]
    assert [c["passed"] for c in trained["cases"]] == [c["passed"] for c in evaluated["cases"]]
    for a, b in zip(trained["cases"], evaluated["cases"]):
        assert a["key_logprob"] == pytest.approx(b["key_logprob"], abs=1e-5)
    assert trained["accuracy"] == evaluated["accuracy"]
    for length, row in zip(evaluated["lengths"], evaluated["accuracy"]):
        assert last[f"passkey_acc/{length}"] == pytest.approx(sum(row) / len(row))
        mine = [c["key_logprob"] for c in evaluated["cases"] if c["length"] == length]
        assert last[f"passkey_logprob/{length}"] == pytest.approx(sum(mine) / len(mine),
                                                                  abs=1e-5)
