"""Hydra app: every recipe composes and validates; the CLI runs end to end and refuses bad input."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import usp.cli as cli
from usp.train.setup import preflight
from usp.validate import check_degrees, check_heads, check_seq_len

ROOT = Path(__file__).resolve().parent.parent
RECIPES = sorted(p.stem for p in (ROOT / "recipes").glob("*.yaml"))
GROUPS = {g: sorted(p.stem for p in (ROOT / "configs" / g).glob("*.yaml"))
          for g in ("model", "parallel", "cluster", "data", "optim", "trainer", "logging")}


def _compose(name="train", overrides=()):
    with initialize_config_dir(config_dir=cli.CONFIG_DIR, version_base="1.3"):
        return OmegaConf.to_object(compose(name, overrides=list(overrides)))


def test_there_are_the_promised_recipes():
    assert {"tiny_cpu", "llama3_8b_128k_h100x16", "qwen2_7b_256k_h100x32"} <= set(RECIPES)
    assert len(RECIPES) >= 4


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_composes_and_is_feasible(recipe):
    cfg = _compose(overrides=[f"recipe={recipe}"])
    world = cfg.cluster.nodes * cfg.cluster.ranks_per_node
    if recipe == "tiny_cpu":
        world = cfg.trainer.nprocs
        assert preflight(cfg, world) == (2, 2)
        return
    u, r = cfg.parallel.ulysses_degree, cfg.parallel.ring_degree
    if u == "auto" or r == "auto":
        from usp.train.setup import resolve_degrees

        u, r, table = resolve_degrees(cfg, world, env={})
        assert "ulysses" in table
    check_degrees(world, u, r)
    check_heads(cfg.model.n_heads, cfg.model.n_kv_heads, u)
    check_seq_len(cfg.data.seq_len, u, r, cfg.parallel.balance)
    assert u <= cfg.cluster.ranks_per_node  # ulysses stays inside a node


def test_recipe_specifics():
    big = _compose(overrides=["recipe=llama3_8b_128k_h100x16"])
    assert (big.parallel.ulysses_degree, big.parallel.ring_degree, big.cluster.nodes) == (8, 2, 2)
    assert big.data.seq_len == 131072 and big.model.n_kv_heads == 8
    q = _compose(overrides=["recipe=qwen2_7b_256k_h100x32"])
    assert q.model.n_kv_heads == 4 and q.parallel.ring_degree * q.parallel.ulysses_degree == 32
    assert q.parallel.ulysses_degree <= q.model.n_kv_heads < q.parallel.ring_degree
    auto = _compose(overrides=["recipe=llama3_8b_1m_auto_h100x32"])
    from usp.train.setup import resolve_degrees

    assert resolve_degrees(auto, 32, env={})[:2] == (8, 4)


@pytest.mark.parametrize("group", sorted(GROUPS))
def test_every_group_option_composes(group):
    for option in GROUPS[group]:
        cfg = _compose(overrides=[f"{group}={option}"])
        assert getattr(cfg, group) is not None


def test_slurm_launcher_config_composes():
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    with initialize_config_dir(config_dir=cli.CONFIG_DIR, version_base="1.3"):
        c = compose("train", overrides=["hydra/launcher=slurm", "recipe=llama3_8b_128k_h100x16"],
                    return_hydra_config=True)
    launcher = c.hydra.launcher
    assert launcher._target_.endswith("SlurmLauncher")
    assert (launcher.nodes, launcher.tasks_per_node, launcher.gpus_per_node) == (2, 8, 8)


def test_typos_and_bad_values_are_errors():
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException):
        _compose(overrides=["parallel.ulysess_degree=2"])
    with pytest.raises(Exception, match="dim"):
        _compose(overrides=["model.dim=abc"])


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


@pytest.mark.parametrize("overrides,needle", [
    (["parallel.ulysses_degree=3"], "ulysses (3) x ring (2) = 6 does not divide world size 4"),
    (["data.seq_len=1012"], "sequence length 1012 is not divisible by 2 x ring x ulysses = 8"),
    (["data=memmap", "data.path=/nonexistent/tokens"], "token file /nonexistent/tokens.bin not found"),
])
def test_cli_refuses_bad_input_before_launch(tmp_path, overrides, needle):
    res = _cli(*overrides, f"hydra.run.dir={tmp_path}", timeout=120)
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
