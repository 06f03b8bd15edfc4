"""The CLI as a command: usp-train runs end to end with overrides, refuses bad input before
any rank starts; usp-plan plans and draws the mesh."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _cli(*args, timeout=600):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, "-c", "from usp.cli import train_main; train_main()",
                           *args], capture_output=True, text=True, cwd=ROOT, env=env,
                          timeout=timeout)


def test_cli_end_to_end_with_overrides(tmp_path):
    run = tmp_path / "run"
    res = _cli("recipe=tiny_cpu", "parallel.ulysses_degree=1", "parallel.ring_degree=4",
               "trainer.steps=4", "data.seq_len=256", "logging.wandb=disabled",
               f"trainer.run_dir={run}", f"hydra.run.dir={tmp_path / 'hydra'}")
    assert res.returncode == 0, res.stderr[-3000:]
    assert "ring=4 ulysses=1" in res.stdout
    assert f"run directory {run}" in res.stdout
    assert (run / "metrics.jsonl").read_text().count("\n") == 4
    assert (run / "curves.png").stat().st_size > 1000
    assert (run / "checkpoints" / "step_000004" / "extra.pt").exists()


REFUSED = [
    (["parallel.ulysses_degree=3"], "ulysses (3) x ring (2) = 6 does not divide world size 4"),
    (["data.seq_len=1012"], "sequence length 1012 is not divisible by 2 x ring x ulysses = 8"),
    (["data=memmap", "data.path=/nonexistent/tokens"], "token file /nonexistent/tokens.bin not found"),
]


@pytest.fixture(scope="module")
def refused(tmp_path_factory) -> dict:
    """Each ``REFUSED`` command line's result, all run in one process (``_cli.run_commands``)."""
    from _cli import run_commands

    tmp = tmp_path_factory.mktemp("refused")
    calls = [("train_main", [*o, f"hydra.run.dir={tmp / str(i)}"]) for i, (o, _) in enumerate(REFUSED)]
    return {tuple(o): res for (o, _), res in zip(REFUSED, run_commands(calls, tmp, timeout=300))}


@pytest.mark.parametrize("overrides,needle", REFUSED)
def test_cli_refuses_bad_input_before_launch(refused, overrides, needle):
    res = refused[tuple(overrides)]
    assert res.returncode != 0
    assert needle in res.stderr + res.stdout
    assert "SPMesh" not in res.stdout  # no rank was started


def test_usp_plan_cli(tmp_path):
    png = tmp_path / "mesh.png"
    res = subprocess.run(
        [sys.executable, "-c", "from usp.cli import plan_main; plan_main()", "model=llama3_8b",
         "cluster=h100_ib", "nodes=4", "data.seq_len=1048576", f"png={png}"],
        capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "choice: dp 1 x ring 4 x ulysses 8" in res.stdout
    assert "reason:" in res.stdout
    assert png.stat().st_size > 1000


def test_a_users_own_config_folder(tmp_path):
    """docs/configuration.md's example: a cluster file and a recipe of one's own, by
    ``--config-dir`` or ``hydra.searchpath``; ``cluster=`` also takes the file's path."""
    import yaml
    from _cli import run_commands

    own = tmp_path / "my_configs"
    (own / "cluster").mkdir(parents=True)
    (own / "recipe").mkdir()
    spec = yaml.safe_load((ROOT / "configs" / "cluster" / "h100_ib.yaml").read_text())
    (own / "cluster" / "my_h200.yaml").write_text(yaml.safe_dump(
        spec | {"name": "my_h200", "nodes": 2, "mem_bytes": 150323855360}))
    (own / "recipe" / "llama3_8b_256k_mine.yaml").write_text(
        "# @package _global_\ndefaults:\n  - override /model: llama3_8b\n"
        "  - override /cluster: my_h200\ndata:\n  seq_len: 262144\n")
    calls = [("plan_main", ["--config-dir", str(own), "recipe=llama3_8b_256k_mine"]),
             ("plan_main", [f"hydra.searchpath=[file://{own}]", "recipe=llama3_8b_256k_mine"]),
             ("plan_main", [f"cluster={own / 'cluster' / 'my_h200.yaml'}", "model=llama3_8b",
                            "data.seq_len=262144"])]
    for res in run_commands(calls, tmp_path, timeout=300):
        assert res.returncode == 0, res.stderr[-2000:]
        assert res.stdout.startswith("plan: world 16 (2 x 8 on my_h200), seq_len 262144"), res.stdout
