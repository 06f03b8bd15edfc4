"""The tier folders against the test files: every test file in a tier folder, every tier with
tests, basenames unique, ``FAST`` real, the markers registered, and the unit tier's guard
(conftest.py) refusing what a unit test must not do."""

import ast
import subprocess
import sys
import tomllib
from collections import Counter
from pathlib import Path

import pytest

import tiers

TESTS = Path(__file__).resolve().parents[1]


def _test_functions() -> dict[str, set[str]]:
    """``<folder>/test_x.py`` (any depth, as a path under tests/) -> its test functions."""
    out = {}
    for f in sorted(TESTS.rglob("test_*.py")):
        tree = ast.parse(f.read_text())
        out[f.relative_to(TESTS).as_posix()] = {
            n.name for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("test")}
    return out


def test_every_file_and_entry_is_real_and_every_tier_known():
    found = _test_functions()
    misplaced = [f"tests/{f}" for f in found if tiers.tier_of(f) is None]
    assert not misplaced, tiers.misplaced(misplaced)
    per_tier = Counter(tiers.tier_of(f) for f, functions in found.items() if functions)
    assert set(per_tier) == set(tiers.NAMES), per_tier  # every tier has tests
    # pytest's default import mode imports each test file by its basename
    basenames = Counter(Path(f).name for f in found)
    assert not [b for b, n in basenames.items() if n > 1], basenames.most_common(3)
    for key in tiers.FAST:  # fast adds distributed tests; unit ones are fast already
        file, _, function = key.partition("::")
        assert file in found and (not function or function in found[file]), key
        assert tiers.tier_of(file) == tiers.DISTRIBUTED, key


def test_markers_are_registered_and_strict():
    ini = tomllib.loads((TESTS.parent / "pyproject.toml").read_text())["tool"]["pytest"]
    registered = {m.split(":")[0] for m in ini["ini_options"]["markers"]}
    assert registered == {*tiers.NAMES, "fast"}
    assert "--strict-markers" in ini["ini_options"]["addopts"]


def test_the_tier_is_the_folder():
    assert tiers.tier_of("unit/test_cli.py") == tiers.UNIT
    assert tiers.tier_of("e2e/test_cli_commands.py") == tiers.E2E
    assert tiers.tier_of("distributed/deeper/test_x.py") == tiers.DISTRIBUTED
    assert tiers.tier_of("test_cli.py") is None  # directly in tests/
    assert tiers.tier_of("lab/test_x.py") is None  # a folder that is no tier
    assert tiers.is_fast("distributed/test_mesh_layout.py", "test_x", tiers.DISTRIBUTED)
    assert not tiers.is_fast("distributed/test_train.py", "test_x", tiers.DISTRIBUTED)
    msg = tiers.misplaced(["tests/test_x.py"])
    assert msg.startswith("tests/test_x.py: in no test tier") and "tests/e2e" in msg


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
    assert len(seen) == 3, seen
    assert "move it to tests/e2e" in seen[0] and "move it to tests/distributed" in seen[2], seen
    seen.clear()
