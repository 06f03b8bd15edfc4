"""The CLIs print a refused input as one line ``usp-...: error: ...`` with status 2, and start
nothing."""

from pathlib import Path

import pytest


TRAIN_REFUSED = [
    ("trainer.steps=0", "trainer.steps=0 must be >= 1"),  # was: rc 0, loss nan
    ("+trainer.foo=1", "unknown config key trainer.foo"),  # was: ignored
    # Hydra's own refusals (were: its lines, a "use +trainer.step=5" hint, exit 1)
    ("trainer.step=5", "unknown config key trainer.step (did you mean trainer.steps?)"),
    ("model=nosuch", "Could not find 'model/nosuch'; options in 'model': hf_llama, "),
    ("cluster=nowhere/mine.yaml", "cluster=nowhere/mine.yaml: no such file"),
    # length phases: a misspelt key inside the list, lengths that shrink (the config), a
    # phase shorter than one step (resolve_phases, in the launching process)
    ("trainer.phases=[{seq_len: 512, stpes: 2}]",
     "unknown config key stpes in trainer.phases (did you mean steps?)"),
    ("trainer.phases=[{seq_len: 1024, steps: 2}, {seq_len: 512, steps: 2}]",
     "trainer.phases[1].seq_len=512 is shorter than phase 0's 1024"),
    ("trainer.phases=[{seq_len: 512, steps: 2}, {seq_len: 1024, tokens: 100}]",
     "trainer.phases[1].tokens=100 is less than one optimizer step of that phase (8192 tokens"),
]
PLAN_REFUSED = "data.seq_len=1001"  # odd: no zigzag layout splits it


@pytest.fixture(scope="module")
def command_lines(tmp_path_factory) -> dict:
    """Each refused command line's result, all run in one process (``_cli.run_commands``)."""
    from _cli import run_commands

    tmp = tmp_path_factory.mktemp("refused")
    calls = [("train_main", [o, f"hydra.run.dir={tmp / str(i)}"])
             for i, (o, _) in enumerate(TRAIN_REFUSED)] + [("plan_main", [PLAN_REFUSED])]
    return {(entry, args[0]): res for (entry, args), res in
            zip(calls, run_commands(calls, tmp, timeout=300))}


@pytest.mark.parametrize("override,needle", TRAIN_REFUSED)
def test_usp_train_refuses_in_one_line(command_lines, override, needle):
    res = command_lines["train_main", override]
    assert res.returncode == 2
    assert res.stderr.startswith("usp-train: error: ") and needle in res.stderr
    assert res.stderr.strip().count("\n") == 0  # one line, no traceback
    assert "SPMesh" not in res.stdout


def test_a_refused_phase_plan_writes_nothing(command_lines, tmp_path_factory):
    i = next(i for i, (o, _) in enumerate(TRAIN_REFUSED) if "tokens: 100" in o)
    run_dir = command_lines["train_main", TRAIN_REFUSED[i][0]].args[-1].split("=", 1)[1]
    written = {p.name for p in Path(run_dir).iterdir()} if Path(run_dir).exists() else set()
    assert not written & {"checkpoints", "metrics.jsonl", "summary.json", "data_record.json"}


def test_usp_plan_refuses_in_one_line(command_lines):
    res = command_lines["plan_main", PLAN_REFUSED]
    assert res.returncode == 2
    assert res.stderr.startswith("usp-plan: error: no feasible layout for world")
    assert "seq_len refused" in res.stderr and "sequence length 1001" in res.stderr
    assert res.stderr.strip().count("\n") == 0
