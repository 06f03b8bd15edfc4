"""Length phases on 4 ranks (``usp.train.phase_runner.train`` with a ``PhasePlan``): three phases
whose layout changes at every boundary (dp 4 at 64 tokens, ulysses 2 x ring 2 at 128, ring
4 at 256, RoPE base raised at each), in the same processes; stopped at a boundary and
mid-phase and resumed, the losses equal the uninterrupted run's; a gate ends a phase early
on an injected passkey score.

All runs share one spawn (process start-up dominates on CPU); the tests read the run
directories."""

import json
import subprocess
import sys
import sysconfig
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from usp.config import (LoggingConfig, MemmapData, ModelConfig, OptimConfig, ParallelConfig,
                        RecallData, RunConfig, TrainerConfig)
from usp.launch import spawn_local
from usp.run import resolve_run
from usp.run.phases import Phase, PhaseGate, PhasePlan
from usp.train.phase_runner import train

ROOT = Path(__file__).resolve().parents[2]
QUIET = LoggingConfig(wandb="disabled", jsonl=True, plot=True, progress=False)
# (seq_len, (ulysses, ring), batch_per_dp_rank, rope_theta, lr): 256 tokens a step throughout
PHASES = [(64, (1, 1), 1, 10000.0, None), (128, (2, 2), 2, 20000.0, 2e-3),
          (256, (1, 4), 1, 40000.0, None)]
STEPS = (3, 3, 3)


def _plan(run_dir, steps=STEPS, gate=None, tokens=None, degrees=None,
          **trainer) -> tuple[RunConfig, PhasePlan]:
    """The base config and its plan, each phase resolved for 4 ranks before any group;
    ``tokens``: the prefix of token files to train on instead of the recall task;
    ``degrees``: {phase: (ulysses, ring)} laid out otherwise (a re-plan)."""
    base = RunConfig(
        model=ModelConfig(vocab_size=320, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                          ffn_dim=128),
        parallel=ParallelConfig(ulysses_degree=1, ring_degree=1, ranks_per_node=4),
        data=RecallData(seq_len=64, batch_per_dp_rank=1, n_pairs=4, n_queries=4),
        optim=OptimConfig(lr=3e-3, warmup_steps=2),
        trainer=TrainerConfig(steps=sum(steps), run_dir=str(run_dir), nprocs=4, **trainer),
        logging=QUIET)
    if tokens is not None:
        base = replace(base, data=MemmapData(path=str(tokens), seq_len=64, batch_per_dp_rank=1))
    phases = []
    for k, ((seq_len, (u, r), b, theta, lr), n) in enumerate(zip(PHASES, steps)):
        u, r = (degrees or {}).get(k, (u, r))
        cfg = replace(base, data=replace(base.data, seq_len=seq_len, batch_per_dp_rank=b),
                      model=replace(base.model, rope_theta=theta),
                      parallel=replace(base.parallel, ulysses_degree=u, ring_degree=r),
                      optim=replace(base.optim, lr=lr or base.optim.lr))
        phases.append(Phase(k, cfg, resolve_run(cfg, 4, "cpu"), n, lr,
                            gate if k == 1 else None))
    return base, PhasePlan(tuple(phases))


def _gate_scores(step: int) -> dict:
    """The injected passkey score: solved from step 5 on (phase 2 starts after step 3)."""
    return {f"passkey_acc/{n}": 1.0 if step >= 5 else 0.5 for n, *_ in PHASES}


def _runs(root, plans):
    """Every run, in one process group; the gated run's validator is a stand-in that
    scores ``_gate_scores`` at every step (the decision is the trainer's). After the run
    stopped mid-phase, rank 0 copies its directory for the re-planned resume."""
    import shutil

    import usp.train.trainer as trainer_module

    for name, (base, plan) in plans.items():
        if name != "gated":
            train(base, plan)
            if name == "mid" and dist.get_rank() == 0:
                shutil.copytree(Path(root) / "mid", Path(root) / "moved")
            dist.barrier()
            continue
        real = trainer_module.Validator

        class Scored(real):
            def should_validate(self, step):
                self.step = step
                return step > 0

            def validate(self, model, step=None):
                return _gate_scores(self.step)

        trainer_module.Validator = Scored
        try:
            train(base, plan)
        finally:
            trainer_module.Validator = real
    dist.barrier()


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("phases")
    tokens = root / "pyjson"  # a small corpus with a validation split (usp-prepare)
    subprocess.run([sys.executable, "-m", "usp.data.prepare", "--src",
                    sysconfig.get_paths()["stdlib"], "--glob", "json/*.py", "--out",
                    str(tokens), "--val-fraction", "0.5", "--quiet"], check=True, cwd=ROOT)
    plans = {"straight": _plan(root / "straight"),
             # stopped exactly at the first boundary, then resumed
             "boundary": _plan(root / "boundary", stop_after=3),
             "boundary+": _plan(root / "boundary"),
             # stopped mid-phase (the second phase's second step), then resumed
             "mid": _plan(root / "mid", stop_after=5),
             "mid+": _plan(root / "mid"),
             # the same checkpoint resumed with the second phase re-planned as ring 4
             "moved+": _plan(root / "moved", degrees={1: (1, 4)}),
             "gated": _plan(root / "gated", steps=(3, 4, 2), gate=PhaseGate(passkey_acc=0.9)),
             # validated every 2 steps: the second phase's short-length loss is within the
             # (wide) margin of the first phase's final loss at its first validation
             "short": _plan(root / "short", steps=(2, 4), tokens=tokens, eval_every=2,
                            eval_windows=4, gate=PhaseGate(val_loss_within=10.0))}
    spawn_local(_runs, 4, str(root), plans)
    return root


def _metrics(run_dir) -> dict:
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return {rec["step"]: rec for rec in map(json.loads, lines)}


def _newest_extra(run_dir) -> dict:
    newest = sorted((Path(run_dir) / "checkpoints").glob("step_*"))[-1]
    return torch.load(newest / "extra.pt", weights_only=False)


def test_three_phases_change_layout_at_every_boundary_and_learn(runs):
    m = _metrics(runs / "straight")
    assert sorted(m) == list(range(1, 10))
    where = [(m[s]["phase"], m[s]["seq_len"], m[s]["dp"], m[s]["ulysses"], m[s]["ring"])
             for s in (1, 4, 7)]
    assert where == [(1, 64, 4, 1, 1), (2, 128, 1, 2, 2), (3, 256, 1, 1, 4)]
    # samples per phase; tokens summed over phases (256 tokens a step throughout)
    assert [m[s]["samples"] for s in range(1, 10)] == [4, 8, 12, 2, 4, 6, 1, 2, 3]
    assert [m[s]["tokens_seen"] for s in range(1, 10)] == [256 * s for s in range(1, 10)]
    # the rate each step used: the run's warmup (3e-3, 2 steps) at steps 1-2, its peak at
    # phase 1's last step, then phase 2's own warmup (2e-3, 2 steps) from its first step
    assert [m[s]["lr"] for s in range(1, 6)] == pytest.approx([1.5e-3, 3e-3, 3e-3, 1e-3, 2e-3])
    extra = _newest_extra(runs / "straight")
    assert (extra["step"], extra["phase"], extra["starts"]) == (9, 2, [0, 3, 6])
    assert extra["tokens_before"] == 256 * 6
    summary = json.loads((runs / "straight" / "summary.json").read_text())
    assert [(p["phase"], p["seq_len"], p["steps"]) for p in summary["phases"]] == [
        (1, 64, [1, 3]), (2, 128, [4, 6]), (3, 256, [7, 9])]
    assert [p["tokens"] for p in summary["phases"]] == [768, 768, 768]
    assert (runs / "straight" / "curves.png").stat().st_size > 0
    # each checkpoint keeps its own phase's model and length (export and usp-eval read them);
    # the run directory's records are the last phase's
    from usp.models.run_records import load_data_record, load_model_config
    run = runs / "straight"
    kept = {int(p.name[5:]): p for p in (run / "checkpoints").glob("step_*")}
    assert sorted(kept) == [6, 9]
    own = [(load_model_config(run, kept[s]).rope_theta, load_data_record(run, kept[s])["seq_len"])
           for s in (6, 9)]
    assert own == [(20000.0, 128), (40000.0, 256)]
    assert (load_model_config(run).rope_theta, load_data_record(run)["seq_len"]) == (40000.0, 256)


def test_stopped_at_a_boundary_or_mid_phase_resumes_into_the_right_phase(runs):
    straight = _metrics(runs / "straight")
    for name in ("boundary", "mid"):
        resumed = _metrics(runs / name)
        assert sorted(resumed) == list(range(1, 10)), name
        for s in range(1, 10):  # the same layouts, the same checkpoints: bit for bit
            assert resumed[s]["loss"] == straight[s]["loss"], (name, s)
            assert resumed[s]["phase"] == straight[s]["phase"], (name, s)
        assert _newest_extra(runs / name)["starts"] == [0, 3, 6]


def test_a_resume_into_a_re_planned_phase_follows_within_1e_5(runs):
    straight, moved = _metrics(runs / "straight"), _metrics(runs / "moved")
    assert [(moved[s]["ulysses"], moved[s]["ring"]) for s in (5, 6)] == [(2, 2), (1, 4)]
    for s in range(6, 10):
        a, b = straight[s]["loss"], moved[s]["loss"]
        assert abs(a - b) <= 1e-5 * a, (s, a, b)


def test_a_gate_ends_its_phase_at_the_validation_where_it_holds(runs):
    m = _metrics(runs / "gated")
    # phase 2 (steps 4..7 planned) ends after step 5, where the score reached 0.9
    assert [m[s]["phase"] for s in sorted(m)] == [1, 1, 1, 2, 2, 3, 3]
    assert m[4]["passkey_acc/128"] == 0.5 and m[5]["passkey_acc/128"] == 1.0
    # what ended each phase: the step bound, the gate, the step bound
    assert [m[s].get("phase_end") for s in sorted(m)] == [None, None, "steps", None, "gate",
                                                         None, "steps"]
    summary = json.loads((runs / "gated" / "summary.json").read_text())
    assert [p["ended_by"] for p in summary["phases"]] == ["steps", "gate", "steps"]
    extra = _newest_extra(runs / "gated")
    assert (extra["step"], extra["starts"]) == (7, [0, 3, 5])


def test_a_later_phase_scores_the_first_phases_length_for_its_gate(runs):
    m = _metrics(runs / "short")
    # step 0 is the validation before the first step (eval_every); the last phase, planned
    # to step 6, ended at step 4
    assert sorted(m) == [0, 1, 2, 3, 4]
    assert "short_val_loss" not in m[2] and "short_val_loss" in m[4]
    assert m[4]["seq_len"] == 128 and m[4]["short_val_loss"] <= 11 * m[2]["val_loss"]
    extra = _newest_extra(runs / "short")
    assert extra["reference_val_loss"] == m[2]["val_loss"]  # the first phase's final loss
    assert (extra["step"], extra["starts"]) == (4, [0, 2])
    summary = json.loads((runs / "short" / "summary.json").read_text())
    assert summary["phases"][1]["short_val_loss"] == m[4]["short_val_loss"]
