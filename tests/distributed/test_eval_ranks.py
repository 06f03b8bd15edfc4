"""usp-eval on a real run (usp-train, 2 gloo ranks, 2 steps, byte tokens): the same cases
scored at (1,1), (2,2) (the command itself, ``usp-eval eval.run_dir=RUN``) and (1,4) give
the same pass/fail, key log-likelihoods and position losses within 1e-5; on the exported
model (usp-export) the scores are what transformers computes on one process for the same
tokens, and usp-eval through the transformers adapter (``model.hf=llama
model.pretrained=EXPORT``, at (2,2)) gives the same scores. A bad input is one line, exit 2."""

import contextlib
import io
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from usp.eval.command import _worker
from usp.eval.job import plan_eval
from usp.run import resolve_eval
from usp.launch import spawn_local
from usp.models.export import main as export_main
from usp.train.phase_runner import train

from _eval_runs import at, byte_corpus, run_cfg

pytest.importorskip("transformers")


def _outputs(out: Path) -> tuple[dict, dict]:
    return (json.loads((out / "passkey.json").read_text()),
            json.loads((out / "position_loss.json").read_text()))


def _jobs(jobs) -> None:
    for job, layout in jobs:
        _worker(job, layout)


def _score(world: int, *scored) -> list[tuple[dict, dict]]:
    """(passkey.json, position_loss.json) of each (cfg, u, r, out, eval keys) of ``scored``,
    all on one launch of ``world`` = u x r ranks."""
    jobs = [plan_eval(at(cfg, u, r, out=str(out), **keys)) for cfg, u, r, out, keys in scored]
    spawn_local(_jobs, world, [(j, resolve_eval(j.cfg, world, "cpu", j.lengths)) for j in jobs])
    return [_outputs(out) for _, _, _, out, _ in scored]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("evalrun")
    cfg = run_cfg(root / "run", byte_corpus(root / "bytes"), u=1, r=2)
    spawn_local(train, 2, cfg)
    with contextlib.redirect_stdout(io.StringIO()):
        assert export_main([str(root / "run"), str(root / "run.hf")]) == 0
    return cfg, root


@pytest.fixture(scope="module")
def commands(run, tmp_path_factory):
    """usp-eval's two command lines on the run, in one process (``_cli.run_commands``: one
    start-up): the scoring at (2,2) and a bad input."""
    from _cli import run_commands

    _, root = run
    tmp = tmp_path_factory.mktemp("evalcli")
    calls = [("eval_main", [f"eval.run_dir={root / 'run'}", "eval.lengths=[128,256]",
                            "eval.depths=[0,0.5,1]", "eval.per_cell=2", "eval.key_digits=3",
                            "eval.windows=2", "eval.buckets=4", f"eval.out={root / 'e22'}",
                            "parallel.ulysses_degree=2", "parallel.ring_degree=2",
                            "trainer.nprocs=4", f"hydra.run.dir={root / 'hydra'}"]),
             ("eval_main", [f"eval.run_dir={root / 'run'}", "eval.lengths=[128,132]",
                            "parallel.ulysses_degree=2", "parallel.ring_degree=2",
                            "trainer.nprocs=4", f"hydra.run.dir={tmp / 'bad'}"])]
    return run_commands(calls, tmp, timeout=300)


def _same(a: tuple[dict, dict], b: tuple[dict, dict]) -> None:
    pa, la = a
    pb, lb = b
    assert [(c["key"], c["length"], c["depth"], c["passed"]) for c in pa["cases"]] == \
        [(c["key"], c["length"], c["depth"], c["passed"]) for c in pb["cases"]]
    diff = max(abs(x["key_logprob"] - y["key_logprob"]) for x, y in zip(pa["cases"], pb["cases"]))
    assert diff <= 1e-5, diff
    assert pa["accuracy"] == pb["accuracy"]
    flat = [(x, y) for ra, rb in zip(la["loss"], lb["loss"]) for x, y in zip(ra, rb)]
    assert len(flat) == 2 * 4 and max(abs(x - y) for x, y in flat) <= 1e-5


def test_the_scores_do_not_depend_on_the_layout(run, commands):
    """(1,1) and (1,4) scored here, (2,2) by the command; (2,2) through the transformers
    adapter on the exported model in the (1,4) launch (checked in the next test)."""
    cfg, root = run
    mine = dict(run_dir=str(root / "run"))
    [one] = _score(1, (cfg, 1, 1, root / "e11", mine))
    assert len(one[0]["cases"]) == 2 * 3 * 2 and one[0]["train_length"] == 128
    out = commands[0]
    assert out.returncode == 0, out.stderr
    assert [line.split(":")[0] for line in out.stdout.splitlines() if line.startswith("passkey")] \
        == ["passkey L=128", "passkey L=256"]
    assert {p.name for p in (root / "e22").iterdir()} == {
        "passkey.json", "passkey.png", "position_loss.json", "position_loss.png"}
    four = [json.loads((root / "e22" / f).read_text()) for f in ("passkey.json",
                                                              "position_loss.json")]
    _same(one, four)
    mc = replace(cfg.model, hf="llama", pretrained=str(root / "run.hf"))
    ring, adapter = _score(4, (cfg, 1, 4, root / "e14", mine),
                           (replace(cfg, model=mc), 2, 2, root / "hf22", {}))
    _same(one, ring)
    _same(one, adapter)


def test_the_exported_model_scores_as_transformers_computes(run):
    from transformers import AutoModelForCausalLM

    cfg, root = run
    if not (root / "hf22").is_dir():
        pytest.skip("needs test_the_scores_do_not_depend_on_the_layout's scores")
    usp, adapter = _outputs(root / "e11")[0], _outputs(root / "hf22")[0]
    assert [c["key"] for c in adapter["cases"]] == [c["key"] for c in usp["cases"]]
    cases = plan_eval(at(cfg, 1, 1, run_dir=str(root / "run"))).cases
    model = AutoModelForCausalLM.from_pretrained(str(root / "run.hf"), local_files_only=True).eval()
    for case, got in zip(cases, usp["cases"]):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([case.tokens])).logits[0].float()  # [L, V]
        rows = torch.arange(case.key_start - 1, case.length - 1)
        target = torch.tensor(case.tokens)[rows + 1]
        logprob = torch.log_softmax(logits[rows], -1).gather(1, target[:, None]).mean().item()
        assert abs(logprob - got["key_logprob"]) <= 1e-5
        assert bool((logits[rows].argmax(-1) == target).all()) == got["passed"]


def test_a_bad_input_is_one_line(commands):
    out = commands[1]
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode == 2 and len(lines) == 1, out.stderr
    assert lines[0].startswith("usp-eval: error: sequence length 132 is not divisible by "
                               "2 x ring x ulysses = 8")
