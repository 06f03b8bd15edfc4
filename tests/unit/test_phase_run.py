"""A run's phases at run time: where each phase ends, the gate's decision, the lr schedule
across phases (``usp.train.build.phase_schedule``) and the line said at a boundary."""

from dataclasses import replace

import pytest
import torch

from usp.config import OptimConfig, RunConfig
from usp.run import RunLayout
from usp.run.phases import Phase, PhaseGate, PhasePlan
from usp.train.build import continue_schedule, lr_lambda, optimizer, phase_schedule

OPTIM = OptimConfig(lr=1e-3, min_lr=1e-4, warmup_steps=2)


def _plan(*phases) -> PhasePlan:
    """Each phase (steps, lr) at 64 x 2**k tokens."""
    cfg = RunConfig(optim=OPTIM)
    run = RunLayout(world=4, dp=4, ring=1, ulysses=1, placement="ulysses_inner",
                    ranks_per_node=None, balance="zigzag", kernel="torch", ring_impl="usp",
                    a2a_chunks=1, device="cpu", dtype="fp32", seq_len=64, batch_per_dp_rank=1)
    return PhasePlan(tuple(Phase(k, replace(cfg, optim=replace(OPTIM, lr=lr or OPTIM.lr)),
                                 replace(run, seq_len=64 * 2 ** k), n, lr)
                           for k, (n, lr) in enumerate(phases)))


def test_starts_and_ends_follow_the_recorded_starts():
    plan = _plan((3, None), (2, None), (4, None))
    assert plan.starts_of((0,)) == (0, 3, 5)
    assert plan.starts_of((0, 1)) == (0, 1, 3)  # phase 0 ended by its gate after step 1
    assert [plan.end(k, (0,)) for k in range(3)] == [3, 5, 9]
    assert plan.end(1, (0, 1)) == 3 and plan.end(2, (0, 1, 2)) == 6


def test_the_gate_needs_every_criterion_it_names():
    both = PhaseGate(passkey_acc=0.9, val_loss_within=0.02)
    assert both.holds(0.9, 1.02, 1.0)
    assert not both.holds(0.85, 1.0, 1.0)  # the passkey is not solved yet
    assert not both.holds(1.0, 1.03, 1.0)  # short-context loss not recovered
    assert PhaseGate(passkey_acc=0.5).holds(0.5, None, None)  # the loss is not asked for
    with pytest.raises(ValueError, match="val_loss_within"):
        both.holds(1.0, 1.0, None)  # no reference: the first phase scored no val_loss
    with pytest.raises(ValueError, match="passkey_acc"):
        both.holds(None, 1.0, 1.0)


def test_a_run_without_phases_gets_todays_schedule():
    plan = _plan((30, None))
    f, today = phase_schedule(OPTIM, plan, (0,)), lr_lambda(OPTIM, 30)
    assert [f(c) for c in range(31)] == [today(c) for c in range(31)]


def test_phases_continue_the_run_schedule_or_start_their_own():
    plan = _plan((4, None), (6, 4e-4), (4, None))
    f, run = phase_schedule(OPTIM, plan, (0,)), lr_lambda(OPTIM, 14)
    # phase 1 (steps 1-4): the run's schedule; the factor after c steps is for step c + 1
    assert [f(c) for c in range(4)] == [run(c) for c in range(4)]
    # phase 2 (steps 5-10): a new peak of 4e-4 (factor 0.4 of the base) after 2 warmup steps,
    # decaying towards min_lr (1e-4: a factor 0.1 of the base 1e-3) over its planned steps
    assert f(4) == pytest.approx(0.4 * 0.5) and f(5) == pytest.approx(0.4)
    assert f(5) == f(6) > f(7) > f(8) > f(9) > 0.1  # the peak, then the cosine
    last = phase_schedule(OPTIM, _plan((4, None), (6, 4e-4)), (0,))
    assert last(10) == pytest.approx(0.1)  # reached after its last step, as today's schedule
    # phase 3 (steps 11-14): the run's schedule again, at the global count
    assert [f(c) for c in range(10, 14)] == [run(c) for c in range(10, 14)]
    # phase 1 ended by its gate after step 2: phase 2's warmup starts there
    g = phase_schedule(OPTIM, plan, (0, 2))
    assert g(2) == pytest.approx(0.4 * 0.5) and g(3) == pytest.approx(0.4)


def test_after_a_load_the_phases_schedule_sets_the_lr():
    plan = _plan((4, None), (6, 4e-4))
    model = torch.nn.Linear(2, 2)
    opt, sched = optimizer(OPTIM, model, phase_schedule(OPTIM, plan, (0,)))
    for _ in range(2):  # phase 1, which its gate ends after step 2
        opt.step()
        sched.step()
    saved_opt, saved_sched = opt.state_dict(), sched.state_dict()
    # phase 2 built anew, the checkpoint loaded: its lr is phase 1's schedule's
    opt, sched = optimizer(OPTIM, model, phase_schedule(OPTIM, plan, (0, 2)))
    opt.load_state_dict(saved_opt)
    sched.load_state_dict(saved_sched)
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-3 * lr_lambda(OPTIM, 10)(2))
    continue_schedule(opt, sched)
    assert opt.param_groups[0]["lr"] == pytest.approx(4e-4 * 0.5)  # phase 2's first warmup step
    # a run without phases: the very lr the checkpoint holds
    one = _plan((10, None))
    opt, sched = optimizer(OPTIM, model, phase_schedule(OPTIM, one, (0,)))
    opt.step()
    sched.step()
    before = opt.param_groups[0]["lr"]
    continue_schedule(opt, sched)
    assert opt.param_groups[0]["lr"] == before


def test_the_boundary_line():
    plan = _plan((4, None), (6, 4e-4), (2, None))
    second = replace(plan[1], run=replace(plan[1].run, dp=1, ring=2, ulysses=2, grad_accum=2),
                     cfg=replace(plan[1].cfg, model=replace(
                         plan[1].cfg.model, rope_theta=40000.0,
                         rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                       "original_max_position_embeddings": 64})))
    plan = replace(plan, phases=(plan[0], second, plan[2]))
    assert plan.describe(1) == ("phase 2/3: seq_len 128, ulysses 2 x ring 2 (dp 1), K=2, "
                                "steps 5..10, rope_theta 40000, rope_scaling yarn x4, "
                                "lr 0.0004 (new warmup)")
    # phase 1 ended by its gate after step 2: phase 2 runs its 6 steps from there
    assert "steps 3..8," in plan.describe(1, (0, 2))
    assert plan.describe(2, (0, 2)).startswith("phase 3/3: seq_len 256, ulysses 1 x ring 1 "
                                               "(dp 4), K=1, steps 9..10, rope_theta 10000")


def test_the_summary_has_a_row_per_phase():
    from usp.train.metrics import phase_table

    def rec(step, phase, seq_len, tokens, **more):
        return {"step": step, "phase": phase, "seq_len": seq_len, "dp": 4 // phase,
                "ring": phase, "ulysses": 1, "loss": 1.0, "step_s": 0.5,
                "tokens_seen": tokens, **more}

    records = [{"step": 0, "val_loss": 9.0},  # step 0's validation: no step
               rec(1, 1, 64, 256), rec(2, 1, 64, 512, val_loss=3.0),
               rec(3, 2, 128, 768, **{"passkey_acc/128": 0.25}),
               rec(4, 2, 128, 1024, short_val_loss=3.1, phase_end="gate",
                   **{"passkey_acc/128": 1.0})]
    assert phase_table(records) == [
        {"phase": 1, "seq_len": 64, "dp": 4, "ring": 1, "ulysses": 1, "steps": [1, 2],
         "tokens": 512, "step_s": 0.5, "tokens_per_s": 512.0, "val_loss": 3.0},
        {"phase": 2, "seq_len": 128, "dp": 2, "ring": 2, "ulysses": 1, "steps": [3, 4],
         "tokens": 512, "step_s": 0.5, "tokens_per_s": 512.0, "ended_by": "gate",
         "short_val_loss": 3.1, "passkey_acc": {"128": 1.0}}]
    assert phase_table([{"step": 5}]) == []  # records from before phases: no table


def test_the_console_says_what_ended_a_phase():
    from usp.run.phases import PhaseGate
    from usp.train.console import phase_end_line

    gate = PhaseGate(passkey_acc=0.9, val_loss_within=0.02)
    rec = {"step": 700, "phase": 1, "seq_len": 128, "phase_end": "gate",
           "passkey_acc/128": 0.9, "short_val_loss": 0.059}
    assert phase_end_line(rec, gate) == (
        "usp: phase 1 ended at step 700: its gate held (passkey_acc >= 0.9 and "
        "val_loss_within 0.02)")
    rec.update(step=1000, phase_end="steps", **{"passkey_acc/128": 0.25})
    assert phase_end_line(rec, PhaseGate(passkey_acc=0.9)) == (
        "usp: phase 1 ended at step 1000, its step bound: its gate (passkey_acc >= 0.9) never "
        "held; at this last validation passkey_acc/128=0.25, short_val_loss=0.059")
    assert phase_end_line(rec, None) == "usp: phase 1 ended at step 1000, its step bound"
