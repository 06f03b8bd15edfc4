"""``trainer.phases`` before any process group: the overlay of each phase on the base config
(``phase_config``), the plan of layouts (``resolve_phases``), the derived ``trainer.steps``,
and the refusals (lengths that shrink, tokens below one step, gates on evaluations that are
not configured, a length no layout fits, ``stop_after`` past the total)."""

from __future__ import annotations

import pytest

from usp.config import (MemmapData, ModelConfig, ParallelConfig, PhaseConfig, PhaseGateConfig,
                        RecallData, RunConfig, TrainerConfig, phase_config)
from usp.config.cluster import ClusterSpec
from usp.run import PhaseGate, resolve_phases, resolve_run

MODEL = dict(vocab_size=320, dim=64, n_heads=4, n_kv_heads=4, ffn_dim=128)


def _cfg(*phases: dict, parallel=None, trainer=None, data=None, **groups) -> RunConfig:
    """4 CPU ranks (2 simulated nodes), degrees 2 x 2 unless ``parallel`` says otherwise."""
    pc = ParallelConfig(**{"ulysses_degree": 2, "ring_degree": 2, "ranks_per_node": 2,
                           **(parallel or {})})
    tc = TrainerConfig(**{"nprocs": 4, "device": "cpu", "steps": 5,
                          "phases": [_phase(p) for p in phases], **(trainer or {})})
    return RunConfig(model=ModelConfig(**MODEL), parallel=pc, trainer=tc,
                     data=data or RecallData(seq_len=64, batch_per_dp_rank=2, n_pairs=2,
                                             n_queries=2),
                     **groups)


def _phase(p: dict) -> PhaseConfig:
    until = p.get("until")
    return PhaseConfig(**{**p, "until": None if until is None else PhaseGateConfig(**until)})


# ---- the overlay ------------------------------------------------------------------------------


def test_a_phase_overlays_the_keys_it_names_and_later_phases_keep_them():
    cfg = _cfg({"seq_len": 64, "steps": 3},
               {"seq_len": 128, "steps": 2, "rope_theta": 40000.0, "lr": 1e-3,
                "batch_per_dp_rank": 1, "ulysses_degree": 1, "ring_degree": 4,
                "expert_degree": 2, "global_batch_tokens": 512},
               {"seq_len": 256, "steps": 2, "rope_scaling": {"rope_type": "linear", "factor": 2}})
    first, second, third = (phase_config(cfg, k) for k in range(3))
    assert (first.data.seq_len, first.model.rope_theta, first.optim.lr) == (64, 10000.0, 2e-3)
    assert (second.data.seq_len, second.data.batch_per_dp_rank, second.model.rope_theta) == \
        (128, 1, 40000.0)
    assert (second.optim.lr, second.trainer.global_batch_tokens) == (1e-3, 512)
    assert (second.parallel.ulysses_degree, second.parallel.ring_degree,
            second.parallel.expert_degree, first.parallel.expert_degree) == (1, 4, 2, 1)
    # the third names only its length and scaling: the raised base, lr and degrees stay
    assert third.model.rope_theta == 40000.0 and third.model.rope_scaling == {
        "rope_type": "linear", "factor": 2.0}
    assert (third.parallel.ulysses_degree, third.parallel.ring_degree,
            third.parallel.expert_degree) == (1, 4, 2)
    assert cfg.data.seq_len == 64 and cfg.model.rope_theta == 10000.0  # the base untouched
    plain = _cfg({"seq_len": 64, "steps": 1, "rope_scaling": {"rope_type": "linear", "factor": 2}},
                 {"seq_len": 64, "steps": 1, "rope_scaling": {"rope_type": "default"}})
    assert phase_config(plain, 1).model.rope_scaling is None  # back to plain RoPE


def test_an_overlay_the_group_refuses_names_the_phase():
    with pytest.raises(ValueError, match=r"trainer.phases\[1\] overlaid on the base config: "
                                         r"optim.min_lr=0.0002 > optim.lr=0.0001"):
        phase_config(_cfg({"seq_len": 64, "steps": 1}, {"seq_len": 64, "steps": 1, "lr": 1e-4}), 1)


@pytest.mark.parametrize("phases,match", [
    ([{"seq_len": 128, "steps": 1}, {"seq_len": 64, "steps": 1}],
     r"trainer.phases\[1\].seq_len=64 is shorter than phase 0's 128"),
    ([{"seq_len": 64}], r"trainer.phases\[0\] has neither steps nor tokens"),
    ([{"seq_len": 64, "steps": 1, "tokens": 9}], r"has both steps and tokens"),
    ([{"steps": 1}], r"trainer.phases\[0\] has no seq_len"),
    ([{"seq_len": 64, "steps": 0}], r"trainer.phases\[0\].steps=0 must be >= 1"),
    ([{"seq_len": 64, "steps": 1, "ring_degree": 0}], r"ring_degree=0 must be a whole number"),
    ([{"seq_len": 64, "steps": 1, "expert_degree": "2"}],
     r"expert_degree='2' must be a whole number"),
    ([{"seq_len": 64, "steps": 1, "until": {"val_loss_within": 0.02}}],
     r"val_loss_within compares .* end of the first phase, which is this one"),
    ([{"seq_len": 64, "steps": 1}, {"seq_len": 64, "steps": 1, "until": {"passkey_acc": 1.5}}],
     r"passkey_acc=1.5 is an accuracy"),
    ([{"seq_len": 64, "steps": 1, "until": {}}], r"until names no criterion"),
    ([{"seq_len": 64, "steps": 1, "rope_scaling": {"rope_type": "yarn"}}],
     r"trainer.phases\[0\]: model.rope_scaling with rope_type yarn needs factor"),
])
def test_plain_values_are_refused_with_the_phase_named(phases, match):
    with pytest.raises(ValueError, match=match):
        _cfg(*phases)


def test_a_phase_may_repeat_the_length_before_it():
    cfg = _cfg({"seq_len": 64, "steps": 1}, {"seq_len": 64, "steps": 1, "rope_theta": 5e4})
    assert len(cfg.trainer.phases) == 2
    assert TrainerConfig(phases=[]).phases is None  # empty: no phases


# ---- the plan ---------------------------------------------------------------------------------


def test_without_phases_the_plan_is_todays_layout():
    cfg = _cfg()
    said: list[str] = []
    plan = resolve_phases(cfg, 4, "cpu", say=said.append)
    assert len(plan) == 1 and plan[0].run == resolve_run(cfg, 4, "cpu")
    # no planner table (fixed degrees); parallel.balance=auto says its choice
    assert plan.cfg is cfg and plan[0].steps == 5
    assert [line for line in said if not line.startswith("usp: balance zigzag")] == []


def test_three_phases_change_the_layout_and_count_steps_globally():
    cfg = _cfg({"seq_len": 64, "steps": 3, "ulysses_degree": 1, "ring_degree": 1},
               {"seq_len": 128, "tokens": 1000, "ulysses_degree": 2, "ring_degree": 2,
                "rope_theta": 40000.0, "lr": 1e-3, "until": {"passkey_acc": 0.9}},
               {"seq_len": 256, "tokens": 1024, "ulysses_degree": 1, "ring_degree": 4},
               trainer={"eval_every": 1, "stop_after": 7},
               parallel={"ulysses_degree": 2, "ring_degree": 2})
    cfg.eval.during_training = True  # the gate's evaluation is configured ...
    with pytest.raises(ValueError, match="eval.during_training=true scores passkey cases"):
        resolve_phases(cfg, 4, "cpu")  # ... but recall data has no text: refused by preflight
    cfg.eval.during_training = False
    cfg.trainer.phases[1].until = None
    said: list[str] = []
    plan = resolve_phases(cfg, 4, "cpu", say=said.append)
    assert [(p.run.dp, p.run.ring, p.run.ulysses) for p in plan.phases] == \
        [(4, 1, 1), (1, 2, 2), (1, 4, 1)]
    assert [p.seq_len for p in plan.phases] == [64, 128, 256]
    # tokens -> ceil(tokens / tokens_per_step): 1000 / (128 x 2) -> 4; 1024 / (256 x 2) -> 2
    assert [p.run.tokens_per_step for p in plan.phases] == [64 * 2 * 4, 128 * 2, 256 * 2]
    assert [p.steps for p in plan.phases] == [3, 4, 2] and plan.total_steps == 9
    assert plan.cfg.trainer.steps == 9 and cfg.trainer.steps == 5  # derived; the input kept
    assert all(p.cfg.trainer.steps == 9 for p in plan.phases)
    assert [p.lr for p in plan.phases] == [None, 1e-3, None]
    assert plan[1].cfg.model.rope_theta == plan[2].cfg.model.rope_theta == 40000.0
    said = [line for line in said if not line.startswith("usp: balance ")]  # each phase's
    assert said[0] == ("phase 1/3: seq_len 64, ulysses 1 x ring 1 (dp 4), K=1, steps 1..3, "
                       "rope_theta 10000")
    assert said[1] == ("phase 2/3: seq_len 128, ulysses 2 x ring 2 (dp 1), K=1, steps 4..7, "
                       "rope_theta 40000, lr 0.001 (new warmup)")
    assert said[-1] == "phases: 3, trainer.steps 9 = 3 + 4 + 2"


def _tokens_with_validation(tmp_path) -> str:
    """Token files with a validation split (usp-prepare's bytes), as a ``data.path``."""
    from usp.data.prepare import prepare

    src = tmp_path / "text"
    src.mkdir()
    for i in range(8):
        (src / f"{i}.txt").write_bytes(f"document {i}: the grass is green. ".encode() * 40)
    prepare(src, "*.txt", tmp_path / "tokens", val_fraction=0.25, log=lambda *a: None)
    return str(tmp_path / "tokens")


def test_the_gate_is_parsed_into_the_plan(tmp_path):
    data = MemmapData(path=_tokens_with_validation(tmp_path), seq_len=64, batch_per_dp_rank=2)
    cfg = _cfg({"seq_len": 64, "steps": 2},
               {"seq_len": 128, "steps": 2, "until": {"val_loss_within": 0.02}},
               trainer={"eval_every": 1}, data=data)
    plan = resolve_phases(cfg, 4, "cpu")
    assert plan[0].until is None and plan[1].until == PhaseGate(val_loss_within=0.02)
    assert "until val_loss_within 0.02" in plan.describe(1)


def test_a_later_layout_that_cannot_hold_the_short_validation_length_is_refused(tmp_path):
    # phase 2 scores short_val_loss on the first phase's windows under its own layout:
    # ulysses 4 x ring 4 (zigzag) holds multiples of 32 tokens, not the first phase's 48
    tokens = _tokens_with_validation(tmp_path)

    def cfg(first: int, data: str = "memmap"):
        dc = (MemmapData(path=tokens, seq_len=first, batch_per_dp_rank=1) if data == "memmap"
              else RecallData(seq_len=first, batch_per_dp_rank=1, n_pairs=2, n_queries=2))
        return _cfg({"seq_len": first, "steps": 2},
                    {"seq_len": 512, "steps": 2, "ulysses_degree": 4, "ring_degree": 4},
                    parallel={"ulysses_degree": 1, "ring_degree": 1, "ranks_per_node": 4},
                    trainer={"nprocs": 16, "eval_every": 1}, data=dc)

    with pytest.raises(ValueError, match=r"trainer.phases\[1\] \(seq_len 512\) on ulysses 4 x "
                                         r"ring 4 scores short_val_loss, the validation loss of "
                                         r"the first phase's 48-token windows.*divisible by 2 x "
                                         r"ring x ulysses = 32.*use seq_len 32 or 64; give "
                                         r"trainer.phases\[0\] such a seq_len"):
        resolve_phases(cfg(48), 16, "cpu")
    plan = resolve_phases(cfg(64), 16, "cpu")  # 64 = 2 x 32: held
    assert [(p.run.dp, p.run.ring, p.run.ulysses) for p in plan.phases] == [(16, 1, 1), (1, 4, 4)]
    resolve_phases(cfg(48, data="recall"), 16, "cpu")  # no validation split: no short loss


def test_stop_after_is_checked_against_the_derived_total():
    phases = ({"seq_len": 64, "steps": 4}, {"seq_len": 128, "steps": 4})
    plan = resolve_phases(_cfg(*phases, trainer={"stop_after": 8}), 4, "cpu")  # > steps 5
    assert plan.cfg.trainer.stop_after == 8 and plan.total_steps == 8
    with pytest.raises(ValueError, match=r"trainer.stop_after=9 is beyond the 8 steps of the "
                                         r"phases \(4 \+ 4\); set it in 1..8"):
        resolve_phases(_cfg(*phases, trainer={"stop_after": 9}), 4, "cpu")
    with pytest.raises(ValueError, match="trainer.stop_after=9 is outside 1..trainer.steps=5"):
        _cfg(trainer={"stop_after": 9})  # without phases: as before


def test_tokens_below_one_step_are_refused():
    cfg = _cfg({"seq_len": 64, "steps": 1}, {"seq_len": 128, "tokens": 100})
    with pytest.raises(ValueError, match=r"trainer.phases\[1\].tokens=100 is less than one "
                                         r"optimizer step of that phase \(256 tokens: seq_len 128 "
                                         r"x batch_per_dp_rank 2 x dp 1 x grad_accum_steps 1\)"):
        resolve_phases(cfg, 4, "cpu")


def test_a_refusal_of_a_phases_layout_names_the_phase():
    cfg = _cfg({"seq_len": 64, "steps": 1}, {"seq_len": 100, "steps": 1})
    with pytest.raises(ValueError, match=r"trainer.phases\[1\] \(seq_len 100\): .*sequence "
                                         r"length 100"):
        resolve_phases(cfg, 4, "cpu")


def test_a_length_no_layout_of_the_world_fits_says_what_would():
    small = ClusterSpec(name="small", ranks_per_node=2, nodes=2, mem_bytes=64 * 2**20)
    cfg = _cfg({"seq_len": 64, "steps": 1}, {"seq_len": 65536, "steps": 1}, cluster=small,
               parallel={"ulysses_degree": "auto", "ring_degree": "auto"})
    with pytest.raises(ValueError) as e:
        resolve_phases(cfg, 4, "cpu", env={})
    text = str(e.value)
    assert text.startswith("trainer.phases[1] (seq_len 65536): no feasible layout for world 4")
    longest = int(text.split("the longest length 4 ranks fit is ")[1].split()[0])
    assert 64 <= longest < 65536
    assert "65536 fits" in text and "nodes of 2" in text


@pytest.mark.parametrize("gate,trainer,match", [
    ({"passkey_acc": 0.9}, {"eval_every": 0}, r"until is checked at validations, but "
                                              r"trainer.eval_every=0"),
    ({"passkey_acc": 0.9}, {"eval_every": 5}, r"passkey_acc=0.9 reads the passkey accuracy at "
                                              r"128 tokens, but eval.during_training=false"),
    ({"val_loss_within": 0.02}, {"eval_every": 5}, r"val_loss_within=0.02 reads the validation "
                                                   r"loss at the first phase's 64 tokens, but "
                                                   r"data=recall has no validation split"),
])
def test_a_gate_on_an_evaluation_not_configured_is_refused(gate, trainer, match):
    cfg = _cfg({"seq_len": 64, "steps": 1}, {"seq_len": 128, "steps": 1, "until": gate},
               trainer=trainer)
    with pytest.raises(ValueError, match=match):
        resolve_phases(cfg, 4, "cpu")


def test_a_passkey_gate_needs_its_length_scored():
    from usp.run import check_gate

    cfg = _cfg({"seq_len": 64, "steps": 1},
               {"seq_len": 128, "steps": 1, "until": {"passkey_acc": 0.9}},
               trainer={"eval_every": 5})
    cfg.eval.during_training, cfg.eval.lengths = True, [64]
    with pytest.raises(ValueError, match=r"eval.lengths=\[64\] does not score it; add 128"):
        check_gate(cfg, 1)
    cfg.eval.lengths = []  # each phase's own length
    check_gate(cfg, 1)


# ---- usp-plan ---------------------------------------------------------------------------------


def _plan_cfg(*phases: dict, mem_mib: int = 256):
    import dataclasses

    from usp.config import PlanConfig

    small = ClusterSpec(name="small", ranks_per_node=2, nodes=2, mem_bytes=mem_mib * 2**20)
    cfg = _cfg(*phases, cluster=small, parallel={"ulysses_degree": "auto", "ring_degree": "auto"})
    return PlanConfig(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)})


def test_usp_plan_says_where_memory_forces_a_new_layout():
    from usp.planner.phase_report import phases_report

    text, _ = phases_report(_plan_cfg({"seq_len": 256, "steps": 1},
                                      {"seq_len": 12288, "steps": 2},
                                      {"seq_len": 24576, "steps": 3}))
    summary = text[text.index("phases on world 4 (2 x 2 on small), trainer.steps 6 = 1 + 2 + 3:"):]
    rows = [line.split()[:5] for line in summary.splitlines()[2:5]]
    assert rows == [["1", "256", "4", "1", "1"], ["2", "12288", "2", "2", "1"],
                    ["3", "24576", "1", "2", "2"]]  # dp 4 -> ring 2 x dp 2 -> ulysses 2 x ring 2
    changes = [line for line in summary.splitlines() if "no longer fits" in line]
    assert changes[0].startswith("phase 2 (12288): ulysses 1 x ring 1 x dp 4 of phase 1 no "
                                 "longer fits (peak ")
    assert changes[0].endswith("> 230.4 MiB); ulysses 1 x ring 2 x dp 2 chosen")
    assert changes[1].startswith("phase 3 (24576): ulysses 1 x ring 2 x dp 2 of phase 2")
    assert [line for line in text.splitlines() if line.startswith("phase ") and "/3" in line] == [
        "phase 1/3: seq_len 256, steps 1..1, rope_theta 10000",
        "phase 2/3: seq_len 12288, steps 2..3, rope_theta 10000",
        "phase 3/3: seq_len 24576, steps 4..6, rope_theta 10000"]


def test_usp_plan_refuses_a_phase_no_layout_fits_with_what_would():
    from usp.planner.phase_report import phases_report

    with pytest.raises(ValueError) as e:
        phases_report(_plan_cfg({"seq_len": 256, "steps": 1}, {"seq_len": 49152, "steps": 1}))
    text = str(e.value)
    assert text.startswith("trainer.phases[1] (seq_len 49152): no feasible layout for world 4")
    assert "the longest length 4 ranks fit is 36624 (dp 1 x ring 4 x ulysses 1); 49152 fits " \
           "4 nodes of 2 (8 ranks)" in text


def test_a_phase_reads_its_own_blend_and_says_it(tmp_path):
    from usp.train.fingerprint import run_fingerprint

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    short, long = _tokens_with_validation(tmp_path / "a"), _tokens_with_validation(tmp_path / "b")
    mix = [{"path": long, "weight": 0.7}, {"path": short, "weight": 0.3}]
    data = MemmapData(path=short, seq_len=64, batch_per_dp_rank=2)
    cfg = _cfg({"seq_len": 64, "steps": 2}, {"seq_len": 128, "steps": 2, "blend": mix},
               {"seq_len": 128, "steps": 1}, data=data)
    first, second, third = (phase_config(cfg, k) for k in range(3))
    assert first.data.path == short and first.data.blend is None
    # the phase's blend replaces the base's one corpus; the phase after keeps it
    for later in (second, third):
        assert later.data.path is None
        assert later.data.sources() == [(long, 0.7), (short, 0.3)]
    plan = resolve_phases(cfg, 4, "cpu")
    assert "blend tokens 0.7 + tokens 0.3" in plan.describe(1)
    assert "blend" not in plan.describe(0) and "blend" not in plan.describe(2)
    # another mix is another plan: its checkpoints are not resumed by this one
    other = _cfg({"seq_len": 64, "steps": 2},
                 {"seq_len": 128, "steps": 2, "blend": [mix[0], {**mix[1], "weight": 0.5}]},
                 {"seq_len": 128, "steps": 1}, data=data)
    assert run_fingerprint(cfg, plan) != run_fingerprint(other, resolve_phases(other, 4, "cpu"))


@pytest.mark.parametrize("blend,data,match", [
    ([], None, r"trainer.phases\[1\].blend is empty"),
    ([{"path": "x", "weight": 1}], "recall", r"trainer.phases\[1\] reads a blend, but "
                                             r"data.kind=recall has no token files"),
    ([{"path": "x", "weight": 0}], "memmap", r"trainer.phases\[1\] overlaid on the base "
                                             r"config: data.blend\[0\].weight=0"),
])
def test_a_phases_blend_is_refused_with_the_phase_named(tmp_path, blend, data, match):
    base = (None if data == "recall" else
            MemmapData(path=_tokens_with_validation(tmp_path), seq_len=64, batch_per_dp_rank=2))
    with pytest.raises(ValueError, match=match):
        cfg = _cfg({"seq_len": 64, "steps": 1}, {"seq_len": 64, "steps": 1, "blend": blend},
                   data=base)
        phase_config(cfg, 1)


def test_a_run_resolved_inside_a_group_needs_its_run_directory():
    """``resolve_phases_group`` resolves a run that trains: without ``trainer.run_dir`` it is
    refused before any collective (so without a process group here), on every rank alike."""
    from usp.run import resolve_phases_group

    with pytest.raises(ValueError, match=r"no run directory: set trainer.run_dir=PATH"):
        resolve_phases_group(_cfg(), "cpu")
