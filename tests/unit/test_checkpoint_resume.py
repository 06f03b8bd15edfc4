"""Resume-config checks (``usp.models.checkpoint.check_resume``): every changed fingerprint
field is named and refused, a changed parallel layout is accepted."""

import pytest

import usp.models.checkpoint as ck
from usp.train.fingerprint import run_fingerprint

from _checkpoint_cfg import run_cfg


def test_check_resume_names_every_changed_key():
    saved = run_fingerprint(run_cfg())
    now = run_fingerprint(run_cfg(optim={"lr": 1e-3}, data={"seq_len": 256},
                                  model={"dim": 128}))
    with pytest.raises(ValueError) as err:
        ck.check_resume(saved, now)
    msg = str(err.value)
    assert "\n" not in msg and "trainer.resume=false" in msg and "run_dir" in msg
    for key in ("optim.lr: 0.003 -> 0.001", "data.seq_len: 128 -> 256", "model.dim: 64 -> 128"):
        assert key in msg, msg
    assert "optim.min_lr" not in msg  # only what changed


@pytest.mark.parametrize("over", [{"optim": {"min_lr": 1e-4}}, {"trainer": {"steps": 7}},
                                  {"trainer": {"dtype": "bf16"}}, {"data": {"kind": "memmap"}},
                                  {"model": {"n_layers": 3}}])
def test_check_resume_refuses_each_fingerprint_field(over):
    with pytest.raises(ValueError, match="cannot resume"):
        ck.check_resume(run_fingerprint(run_cfg()), run_fingerprint(run_cfg(**over)))


def test_check_resume_accepts_a_changed_parallel_layout():
    saved = run_fingerprint(run_cfg(u=2, r=2))
    for u, r in ((4, 1), (1, 4), (1, 1)):
        ck.check_resume(saved, run_fingerprint(run_cfg(u=u, r=r)))  # no error
    ck.check_resume(saved, run_fingerprint(run_cfg(parallel={"balance": "contiguous"})))
    # the tilings too: an auto one re-sized for the new layout resumes
    tiled = {"loss_chunk": 16, "mlp_tiles": 4, "norm_tiles": 2}
    ck.check_resume(saved, run_fingerprint(run_cfg(u=1, r=4, model=tiled)))


# ---- length phases: any phase of the same plan resumes, another plan is refused -----------

def _plan(cfg, *phases, world=4):
    """A plan by hand: each phase (seq_len, steps, rope_theta, lr, until, (ulysses, ring))
    over ``cfg``, its layout a plain one of ``world`` ranks."""
    from dataclasses import replace

    from usp.run import RunLayout
    from usp.run.phases import Phase, PhasePlan

    out = []
    for k, (seq_len, steps, theta, lr, until, (u, r)) in enumerate(phases):
        c = replace(cfg, data=replace(cfg.data, seq_len=seq_len),
                    model=replace(cfg.model, rope_theta=theta))
        run = RunLayout(world=world, dp=world // (u * r), ring=r, ulysses=u,
                        placement="ulysses_inner", ranks_per_node=None, balance="zigzag",
                        kernel="torch", ring_impl="usp", a2a_chunks=1, device="cpu",
                        dtype="fp32", seq_len=seq_len, batch_per_dp_rank=2)
        out.append(Phase(k, c, run, steps, lr, until))
    return PhasePlan(tuple(out))


def test_single_phase_fingerprint_is_unchanged():
    from usp.run.phases import PhasePlan

    cfg = run_cfg()
    single = _plan(cfg, (128, 6, 10000.0, None, None, (2, 2)))
    assert run_fingerprint(cfg, single) == run_fingerprint(cfg)
    assert run_fingerprint(cfg, PhasePlan.single(cfg, single[0].run)) == run_fingerprint(cfg)
    assert "trainer.phases" not in run_fingerprint(cfg)


def test_fingerprint_accepts_the_same_plan_under_any_layout_and_refuses_another_plan():
    from usp.run.phases import PhaseGate

    cfg = run_cfg()
    gate = PhaseGate(passkey_acc=0.9)
    phases = [(64, 3, 10000.0, None, None, (1, 1)), (128, 2, 40000.0, 1e-3, gate, (2, 2)),
              (256, 4, 80000.0, None, None, (1, 4))]
    saved = run_fingerprint(cfg, _plan(cfg, *phases))
    assert saved["trainer.phases"].count("seq_len=") == 3
    assert "rope_theta=40000.0" in saved["trainer.phases"] and "passkey_acc>=0.9" in saved[
        "trainer.phases"]
    # the same plan laid out otherwise (another world, other degrees): the same fingerprint
    moved = [p[:5] + ((1, 2),) for p in phases]
    ck.check_resume(saved, run_fingerprint(cfg, _plan(cfg, *moved, world=2)))
    # another plan: each of its settings is refused, by name
    for k, i, value in ((1, 0, 512), (2, 1, 5), (1, 2, 20000.0), (1, 3, 2e-3),
                        (1, 4, PhaseGate(passkey_acc=0.8)), (2, 4, gate)):
        other = [list(p) for p in phases]
        other[k][i] = value
        with pytest.raises(ValueError, match="trainer.phases: "):
            ck.check_resume(saved, run_fingerprint(cfg, _plan(cfg, *map(tuple, other))))
    with pytest.raises(ValueError, match="trainer.phases"):  # a phase more or less
        ck.check_resume(saved, run_fingerprint(cfg, _plan(cfg, *phases[:2])))


def test_a_checkpoints_step_is_read_from_its_name_and_none_from_another():
    """usp-eval scores any verified checkpoint directory, a renamed copy included."""
    from pathlib import Path

    assert ck.step_of(Path("run/checkpoints/step_000700")) == 700
    assert ck.step_of(Path("run/best")) is None
