"""The CLIs print a refused input as one line ``usp-...: error: ...`` with status 2, and start
nothing."""

from pathlib import Path

import pytest
import torch

TRAIN_REFUSED = [
    ("trainer.steps=0", "trainer.steps=0 must be >= 1"),  # was: rc 0, loss nan
    ("+trainer.foo=1", "unknown config key trainer.foo"),  # was: ignored
    # Hydra's own refusals (were: its lines, a "use +trainer.step=5" hint, exit 1)
    ("trainer.step=5", "unknown config key trainer.step (did you mean trainer.steps?)"),
    ("model=nosuch", "Could not find 'model/nosuch'; options in 'model': hf_llama, "),
    ("cluster=nowhere/mine.yaml", "cluster=nowhere/mine.yaml: no such file"),
    # length phases: a misspelt key inside the list, lengths that shrink (the config), a
    # phase shorter than one step (resolve_phases, in the launching process)
    ("trainer.phases=[{seq_len: 512, steps: 2}, {seq_len: 1024, stpes: 2}]",
     "unknown config key trainer.phases[1].stpes (did you mean trainer.phases[1].steps?)"),
    ("trainer.phases=[{seq_len: 1024, steps: 2}, {seq_len: 512, steps: 2}]",
     "trainer.phases[1].seq_len=512 is shorter than phase 0's 1024"),
    ("trainer.phases=[{seq_len: 512, steps: 2}, {seq_len: 1024, tokens: 100}]",
     "trainer.phases[1].tokens=100 is less than one optimizer step of that phase (8192 tokens"),
]
if not torch.cuda.is_available():  # before anything is spawned (was test_launch_once_commands')
    TRAIN_REFUSED.append(("trainer.device=cuda",
                          "trainer.device=cuda but this process sees 0 CUDA GPUs"))
PLAN_REFUSED = "cluster.mem_bytes=1000000"  # no layout fits 1 MB (an odd length is rounded up)
EVAL_REFUSED = ("eval.run_dir=/nonexistent/run", "/nonexistent/run")


@pytest.fixture(scope="module")
def command_lines(tmp_path_factory) -> dict:
    """Each refused command line's result, all run in one process (``_cli.run_commands``)."""
    from _cli import run_commands

    tmp = tmp_path_factory.mktemp("refused")
    # each in a run directory two new folders deep, as Hydra's default runs/<time> can be
    calls = [("train_main", [o, f"hydra.run.dir={tmp / str(i) / 'runs' / 'now'}"])
             for i, (o, _) in enumerate(TRAIN_REFUSED)] + [("plan_main", [PLAN_REFUSED])]
    calls.append(("eval_main", [EVAL_REFUSED[0], f"hydra.run.dir={tmp / 'eval' / 'runs' / 'now'}"]))
    return {(entry, args[0]): res for (entry, args), res in
            zip(calls, run_commands(calls, tmp, timeout=300))}


@pytest.mark.parametrize("override,needle", TRAIN_REFUSED)
def test_usp_train_refuses_in_one_line(command_lines, override, needle):
    res = command_lines["train_main", override]
    assert res.returncode == 2
    assert res.stderr.startswith("usp-train: error: ") and needle in res.stderr
    assert res.stderr.strip().count("\n") == 0  # one line, no traceback
    assert "SPMesh" not in res.stdout


def test_a_refused_command_writes_nothing(command_lines):
    """Not even Hydra's run directory (``.hydra/``, the job log) or the folders it made
    above it: every refusal, Hydra's own and usp's after Hydra made the directory."""
    for (entry, first), res in command_lines.items():
        if entry == "plan_main":
            continue
        assert res.returncode == 2, res.stderr
        made = Path(res.args[-1].split("=", 1)[1]).parent.parent  # tmp/i (runs/now below it)
        assert not made.exists(), (first, sorted(p.name for p in made.rglob("*")))


def test_usp_eval_refuses_in_one_line(command_lines):
    res = command_lines["eval_main", EVAL_REFUSED[0]]
    assert res.stderr.startswith("usp-eval: error: ") and EVAL_REFUSED[1] in res.stderr
    assert res.stderr.strip().count("\n") == 0


def test_usp_plan_refuses_in_one_line(command_lines):
    res = command_lines["plan_main", PLAN_REFUSED]
    assert res.returncode == 2
    assert res.stderr.startswith("usp-plan: error: no feasible layout for world")
    assert "memory refused" in res.stderr and "largest term state" in res.stderr
    assert res.stderr.strip().count("\n") == 0
