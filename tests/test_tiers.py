"""tests/tiers.py against the test files: every file listed, every entry real, the markers
registered, and the unit tier's guard (conftest.py) refusing what a unit test must not do."""

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import tiers

HERE = Path(__file__).resolve().parent


def _test_functions() -> dict[str, set[str]]:
    out = {}
    for f in sorted(HERE.glob("test_*.py")):
        tree = ast.parse(f.read_text())
        out[f.name] = {n.name for n in tree.body
                       if isinstance(n, ast.FunctionDef) and n.name.startswith("test")}
    return out


def test_every_file_and_entry_is_real_and_every_tier_known():
    found = _test_functions()
    for key, tier in tiers.TIERS.items():
        assert tier in tiers.NAMES, (key, tier)
        file, _, function = key.partition("::")
        assert file in found, f"{key}: no tests/{file}"
        assert not function or function in found[file], f"{key}: no such test function"
    unlisted = set(found) - {k.partition("::")[0] for k in tiers.TIERS}
    assert not unlisted, f"in no tier: {sorted(unlisted)}"
    for key in tiers.FAST:  # fast adds distributed tests; unit ones are fast already
        file, _, function = key.partition("::")
        assert file in found and (not function or function in found[file]), key
        assert tiers.tier_of(file, function) == tiers.DISTRIBUTED, key


def test_markers_are_registered_and_strict():
    ini = tomllib.loads((HERE.parent / "pyproject.toml").read_text())["tool"]["pytest"]
    registered = {m.split(":")[0] for m in ini["ini_options"]["markers"]}
    assert registered == {*tiers.NAMES, "fast"}
    assert "--strict-markers" in ini["ini_options"]["addopts"]


def test_tier_of_prefers_the_function_entry():
    assert tiers.tier_of("test_cli.py", "test_recipe_specifics") == tiers.UNIT
    assert tiers.tier_of("test_cli.py", "test_usp_plan_cli") == tiers.E2E
    assert tiers.tier_of("test_nothing_here.py", "test_x") is None


def test_a_unit_test_cannot_start_python_or_a_process_group(_unit_stays_in_process):
    import multiprocessing

    import torch.distributed as dist

    assert subprocess.run(["true"]).returncode == 0  # other programs are allowed
    starts = {"subprocess": lambda: subprocess.run([sys.executable, "-c", "pass"]),
              "spawn": lambda: multiprocessing.get_context("spawn").Process(target=print).start(),
              "group": lambda: dist.init_process_group("gloo", rank=0, world_size=1)}
    for what, start in starts.items():
        with pytest.raises(RuntimeError, match="is in tier unit but"):
            start()
    seen = _unit_stays_in_process  # what the guard would fail this test with at teardown
    assert len(seen) == 3 and "as e2e" in seen[0] and "as distributed" in seen[2], seen
    seen.clear()
