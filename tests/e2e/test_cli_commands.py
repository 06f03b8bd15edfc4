"""The CLI as a command: usp-train runs end to end with overrides, refuses bad input before
any rank starts; usp-plan plans and draws the mesh, from a config folder of one's own too.
Every command line runs in one process (``_cli.run_commands``: one start-up, not one per
command); the tests read their results."""

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

REFUSED = [
    (["parallel.ulysses_degree=3"], "ulysses (3) x ring (2) = 6 does not divide world size 4"),
    (["data.seq_len=1012"], "sequence length 1012 is not divisible by 2 x ring x ulysses = 8"),
    (["data=memmap", "data.path=/nonexistent/tokens"], "token file /nonexistent/tokens.bin not found"),
]


def _own_configs(own: Path) -> list[list[str]]:
    """docs/configuration.md's example: a cluster file and a recipe of one's own in ``own``;
    usp-plan's arguments that reach them by ``--config-dir``, ``hydra.searchpath`` and
    ``cluster=`` the file's path."""
    import yaml

    (own / "cluster").mkdir(parents=True)
    (own / "recipe").mkdir()
    spec = yaml.safe_load((ROOT / "configs" / "cluster" / "h100_ib.yaml").read_text())
    (own / "cluster" / "my_h200.yaml").write_text(yaml.safe_dump(
        spec | {"name": "my_h200", "nodes": 2, "mem_bytes": 150323855360}))
    (own / "recipe" / "llama3_8b_256k_mine.yaml").write_text(
        "# @package _global_\ndefaults:\n  - override /model: llama3_8b\n"
        "  - override /cluster: my_h200\ndata:\n  seq_len: 262144\n")
    return [["--config-dir", str(own), "recipe=llama3_8b_256k_mine"],
            [f"hydra.searchpath=[file://{own}]", "recipe=llama3_8b_256k_mine"],
            [f"cluster={own / 'cluster' / 'my_h200.yaml'}", "model=llama3_8b",
             "data.seq_len=262144"]]


@pytest.fixture(scope="module")
def commands(tmp_path_factory) -> dict:
    """name -> its command's result (returncode, stdout, stderr), and "tmp": their folder."""
    from _cli import run_commands

    tmp = tmp_path_factory.mktemp("commands")
    calls = {"train": ("train_main", [
        "recipe=tiny_cpu", "parallel.ulysses_degree=1", "parallel.ring_degree=4",
        "trainer.steps=4", "data.seq_len=256", "logging.wandb=disabled",
        f"trainer.run_dir={tmp / 'run'}", f"hydra.run.dir={tmp / 'hydra'}"])}
    for i, (overrides, _) in enumerate(REFUSED):
        calls[tuple(overrides)] = ("train_main", [*overrides, f"hydra.run.dir={tmp / str(i)}"])
    calls["plan"] = ("plan_main", ["model=llama3_8b", "cluster=h100_ib", "nodes=4",
                                   "data.seq_len=1048576", f"png={tmp / 'mesh.png'}"])
    for i, args in enumerate(_own_configs(tmp / "my_configs")):
        calls[f"own{i}"] = ("plan_main", args)
    results = run_commands(list(calls.values()), tmp, timeout=600)
    return {"tmp": tmp, **dict(zip(calls, results))}


def test_cli_end_to_end_with_overrides(commands):
    res, run = commands["train"], commands["tmp"] / "run"
    assert res.returncode == 0, res.stderr[-3000:]
    assert "ring=4 ulysses=1" in res.stdout
    assert f"run directory {run}" in res.stdout
    assert (run / "metrics.jsonl").read_text().count("\n") == 4
    assert (run / "curves.png").stat().st_size > 1000
    assert (run / "checkpoints" / "step_000004" / "extra.pt").exists()


@pytest.mark.parametrize("overrides,needle", REFUSED)
def test_cli_refuses_bad_input_before_launch(commands, overrides, needle):
    res = commands[tuple(overrides)]
    assert res.returncode != 0
    assert needle in res.stderr + res.stdout
    assert "SPMesh" not in res.stdout  # no rank was started


def test_usp_plan_cli(commands):
    res = commands["plan"]
    assert res.returncode == 0, res.stderr[-3000:]
    assert "choice: dp 1 x ring 4 x ulysses 8" in res.stdout
    assert "reason:" in res.stdout
    assert (commands["tmp"] / "mesh.png").stat().st_size > 1000


def test_a_users_own_config_folder(commands):
    """docs/configuration.md's example: a cluster file and a recipe of one's own, by
    ``--config-dir`` or ``hydra.searchpath``; ``cluster=`` also takes the file's path."""
    for name in ("own0", "own1", "own2"):
        res = commands[name]
        assert res.returncode == 0, res.stderr[-2000:]
        assert res.stdout.startswith("plan: world 16 (2 x 8 on my_h200), seq_len 262144"), res.stdout
