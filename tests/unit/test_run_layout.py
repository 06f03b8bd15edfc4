"""The run resolved once: ``usp.run.RunLayout`` is the only place that reads the parallel
config's decisions; the layout checks itself; a refusal is printed by one task only.
(That the launcher resolves once per launch is in ``test_launch_once.py``.)"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from usp.config import ModelConfig, ParallelConfig, RecallData, RunConfig, TrainerConfig
from usp.planner.cost import best_a2a_chunks
from usp.run import RunLayout, resolve_run

PACKAGE = Path(__file__).resolve().parents[2] / "usp"
# the resolver, the dataclasses that define the fields, and the planner's ranking of a config
OWNERS = ("run", "config", "planner/report.py")
DEGREES = {"ulysses_degree", "ring_degree", "dp_degree"}


def config_reads(source: str) -> list[str]:
    """Attribute reads of the raw parallel config: ``x.parallel`` or ``x.<degree field>``."""
    return [f"line {n.lineno}: .{n.attr}" for n in ast.walk(ast.parse(source))
            if isinstance(n, ast.Attribute) and (n.attr == "parallel" or n.attr in DEGREES)]


def test_only_the_resolver_reads_the_parallel_config():
    found = []
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE)
        if rel.parts[0] in OWNERS or rel.as_posix() in OWNERS:
            continue
        found += [f"usp/{rel} {hit}" for hit in config_reads(path.read_text())]
    assert not found, "decided again outside usp/run/:\n" + "\n".join(found)


def test_the_read_check_can_fail():
    code = "def f(cfg):\n    pc = cfg.parallel\n    return run.ulysses, cfg.x.ring_degree\n"
    assert config_reads(code) == ["line 2: .parallel", "line 3: .ring_degree"]
    assert config_reads("def f(run):\n    return run.ulysses * run.ring\n") == []


def _cfg(**parallel) -> RunConfig:
    return RunConfig(model=ModelConfig(vocab_size=320, dim=64, n_heads=4, n_kv_heads=2),
                     parallel=ParallelConfig(**parallel),
                     data=RecallData(seq_len=128, batch_per_dp_rank=3),
                     trainer=TrainerConfig(nprocs=8, dtype="bf16"))


def test_resolved_layout_holds_every_decision():
    cfg = _cfg(ulysses_degree=2, ring_degree=2, a2a_chunks=2, ranks_per_node=4)
    run = resolve_run(cfg, 8, "cpu")
    assert (run.world, run.dp, run.ring, run.ulysses, run.sp) == (8, 2, 2, 2, 4)
    assert (run.a2a_chunks, run.device, run.dtype, run.ranks_per_node) == (2, "cpu", "bf16", 4)
    assert (run.global_batch, run.tokens_per_step) == (6, 6 * 128)
    assert run.attention_options() == dict(kernel="torch", ring_impl="usp")  # stages: the mesh's
    assert cfg.parallel.a2a_chunks == 2 and cfg.parallel.dp_degree is None  # config untouched
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.ulysses = 4


def test_the_run_directory_is_decided_into_the_layout_not_into_the_config(tmp_path):
    cfg = _cfg()
    assert cfg.trainer.run_dir is None
    run = resolve_run(cfg, 8, "cpu", run_dir=str(tmp_path / "hydra"))  # the launcher's folder
    assert run.run_dir == str(tmp_path / "hydra") and cfg.trainer.run_dir is None
    assert resolve_run(cfg, 8, "cpu").run_dir is None  # a layout to plan with
    mine = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, run_dir="mine"))
    assert resolve_run(mine, 8, "cpu", run_dir=str(tmp_path)).run_dir == "mine"  # set: it wins
    assert run.dims.world == 8 and (run.dims.ring, run.dims.ulysses) == (run.ring, run.ulysses)


def test_layout_refuses_degrees_that_do_not_make_its_world():
    run = resolve_run(_cfg(), 8, "cpu")
    with pytest.raises(ValueError, match="ulysses"):
        dataclasses.replace(run, dp=3)
    with pytest.raises(ValueError, match="ranks_per_node"):
        dataclasses.replace(run, ranks_per_node=3)


def test_auto_chunks_are_one_inside_a_node_and_the_planners_count_across():
    assert ParallelConfig().a2a_chunks == "auto"  # the default
    inside = _cfg(ulysses_degree=2, ring_degree=2, ranks_per_node=2)  # u=2 inside a node
    assert resolve_run(inside, 4, "cpu").a2a_chunks == 1
    long = RecallData(seq_len=1 << 16, batch_per_dp_rank=1)  # long enough to pipeline
    across = dataclasses.replace(_cfg(ulysses_degree=2, ring_degree=2, ranks_per_node=1),
                                 data=long)  # u=2 over two nodes
    m = across.model
    assert resolve_run(across, 4, "cpu").a2a_chunks == best_a2a_chunks(
        across.cluster.replace(ranks_per_node=1, nodes=4), 1 << 16, m.n_heads, m.n_kv_heads,
        m.head_dim, 2, 2, dp=1, dtype_bytes=2, placement="ulysses_inner") == 2
    # without parallel.ranks_per_node the launcher's topology decides (torchrun's variables)
    torchrun = dataclasses.replace(_cfg(ulysses_degree=2, ring_degree=2), data=long)
    for per_node, want in (("4", 1), ("1", 2)):
        env = {"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": per_node, "RANK": "0", "LOCAL_RANK": "0"}
        assert resolve_run(torchrun, 4, "cpu", env=env).a2a_chunks == want, per_node
    # a local launch that names no nodes: its processes share one host, as the mesh finds
    assert torchrun.cluster.ranks_per_node < 4  # the config's cluster alone would split them
    assert resolve_run(torchrun, 4, "cpu", env={}).a2a_chunks == 1


def test_resolve_checks_the_heads_once_and_says_the_planners_table_once(monkeypatch):
    import usp.run.preflight as preflight
    from _auto_layout import RANK_ENVS, auto_cfg

    calls = []
    real = preflight.check_heads
    monkeypatch.setattr(preflight, "check_heads", lambda *a: calls.append(a) or real(*a))
    said = []
    run = resolve_run(auto_cfg(), 2, "cpu", env=RANK_ENVS[0], say=said.append)
    assert calls == [(8, 8, run.ulysses)]  # the chosen degree, checked once
    tables = [s for s in said if "plan: world" in s]
    assert len(tables) == 1 and "plan: world 2" in tables[0]
    assert said[0] == "usp: balance zigzag (parallel.balance=auto: the rows are one causal " \
                      "sequence each (data.packing=none))"  # said first, before the table
    assert "plan_table" not in {f.name for f in dataclasses.fields(RunLayout)}  # data only
    said.clear()
    resolve_run(_cfg(), 8, "cpu", say=said.append)
    assert said == ["usp: balance zigzag (parallel.balance=auto: the rows are one causal "
                    "sequence each (data.packing=none))"]  # fixed degrees: no table


def test_the_inputs_are_checked_before_anything_is_decided(monkeypatch, tmp_path):
    import usp.run.decide as decide
    from _auto_layout import auto_cfg

    monkeypatch.setattr(decide, "detect_topology", lambda *a, **k: pytest.fail("detected"))
    cfg = auto_cfg()
    cfg.trainer.run_dir = str(tmp_path / "file" / "run")
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="cannot be a directory"):
        resolve_run(cfg, 2, "cpu", env={})  # refused before the topology is detected


@pytest.mark.parametrize("rank,printed", [(0, True), (1, False)])
def test_a_refusal_is_printed_by_the_first_task_only(monkeypatch, capsys, rank, printed):
    from usp import cli
    from usp.launch import SharedRefusal

    monkeypatch.setenv("RANK", str(rank))  # torchrun (under Slurm: tests/unit/test_slurm.py)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit) as e:  # decided together before the group: every task has it
        cli._refuse("usp-train", SharedRefusal("sequence length 100 is not divisible by 8"))
    assert e.value.code == 2  # every task exits with the refusal's status
    err = capsys.readouterr().err
    assert ("usp-train: error: sequence length 100" in err) is printed
