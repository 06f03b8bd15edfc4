"""``usp.run.phases``: a run's phases and which phase a global step belongs to."""

from dataclasses import replace

import pytest

from usp.config import RunConfig
from usp.run import RunLayout
from usp.run.phases import Phase, PhasePlan


def _plan(*steps: int) -> PhasePlan:
    cfg = RunConfig()
    run = RunLayout(world=1, dp=1, ring=1, ulysses=1, placement="ulysses_inner",
                    ranks_per_node=None, balance="zigzag", kernel="torch", ring_impl="usp",
                    a2a_chunks=1, device="cpu", dtype="fp32", seq_len=64, batch_per_dp_rank=1)
    return PhasePlan(tuple(Phase(k, cfg, replace(run, seq_len=64 * 2 ** k), n)
                           for k, n in enumerate(steps)))


def test_single_is_one_phase_of_trainer_steps():
    plan = _plan(1)
    one = PhasePlan.single(plan[0].cfg, plan[0].run)
    assert len(one) == 1 and one.total_steps == RunConfig().trainer.steps
    assert one.planned_starts == (0,)


def test_planned_phase_of_each_step():
    plan = _plan(3, 2, 4)
    assert plan.total_steps == 9 and plan.planned_starts == (0, 3, 5)
    assert [plan.phase_at(s) for s in range(1, 10)] == [0, 0, 0, 1, 1, 2, 2, 2, 2]
    assert [p.seq_len for p in plan.phases] == [64, 128, 256]


def test_recorded_starts_move_the_later_phases():
    plan = _plan(3, 2, 4)
    # phase 0 ended early by its gate after step 1: phase 1 runs steps 2-3, phase 2 from 4
    assert [plan.phase_at(s, starts=(0, 1)) for s in range(1, 8)] == [0, 1, 1, 2, 2, 2, 2]
    assert [plan.phase_at(s, starts=(0, 1, 2)) for s in range(1, 5)] == [0, 1, 2, 2]


def test_an_empty_plan_is_refused():
    with pytest.raises(ValueError, match="at least one phase"):
        PhasePlan(())
