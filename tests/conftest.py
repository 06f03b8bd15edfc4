"""Test tiers as markers: the folder under ``tests/`` is the tier (``tests/tiers.py``), and the
unit tier's promise checked.

    python -m pytest -q                  # every tier (root, slurm tests skip themselves without root)
    python -m pytest -q tests/unit       # one tier: unit, distributed, e2e, root, slurm, gpu
    python -m pytest -q -m fast          # unit + a few quick multi-rank tests
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))  # spawned workers import tests' helpers by name

import tiers  # noqa: E402  (found through the path above)


def _under_tests(path) -> str | None:
    """``path`` relative to ``tests/`` (``unit/test_cli.py``); None outside it."""
    try:
        return Path(path).resolve().relative_to(TESTS).as_posix()
    except ValueError:
        return None


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(config, items):
    misplaced: set[str] = set()
    no_cuda = None
    for item in items:
        file, function = _under_tests(item.path), getattr(item, "originalname", item.name)
        tier = tiers.tier_of(file) if file else None
        if tier is None:
            misplaced.add(f"tests/{file}" if file else str(item.path))
            continue
        item.add_marker(tier)
        if tiers.is_fast(file, function, tier):
            item.add_marker("fast")
        if tier == tiers.GPU:
            if no_cuda is None:
                import torch

                no_cuda = not torch.cuda.is_available()
            if no_cuda:
                item.add_marker(pytest.mark.skip(reason="tier gpu: needs CUDA, none here"))
    if misplaced:
        raise pytest.UsageError(tiers.misplaced(sorted(misplaced)))


_PROGRAMS = {"torchrun", "usp-train", "usp-plan"}


def _starts_python(args) -> bool:
    argv = args.split() if isinstance(args, (str, bytes)) else list(args)
    if not argv:
        return False
    prog = os.fsdecode(argv[0])
    name = os.path.basename(prog)
    exe = shutil.which(prog) or prog
    return (name.startswith("python") or name in _PROGRAMS
            or os.path.realpath(exe) == os.path.realpath(sys.executable))


@pytest.fixture(autouse=True)
def _unit_stays_in_process(request, monkeypatch):
    """A unit test that starts a Python process, a rank or a process group fails, naming the
    tier it belongs to; stand-ins a test installs itself (monkeypatch) take precedence."""
    seen: list[str] = []  # what it refused (yielded: a test of the guard clears it)
    if request.node.get_closest_marker(tiers.UNIT) is None:
        yield seen
        return
    import multiprocessing.process

    import torch.distributed as dist

    def refuse(what: str, fix: str):
        seen.append(f"{request.node.nodeid} is in tier unit but {what}; move it to {fix}")
        raise RuntimeError(seen[-1])

    popen_init = subprocess.Popen.__init__

    def popen(self, args, *a, **kw):
        if _starts_python(args):
            refuse(f"runs {args!r} in a subprocess", "tests/e2e (or tests/distributed)")
        popen_init(self, args, *a, **kw)

    monkeypatch.setattr(subprocess.Popen, "__init__", popen)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start",
                        lambda self: refuse("spawns a process", "tests/distributed"))
    monkeypatch.setattr(dist, "init_process_group",
                        lambda *a, **kw: refuse("makes a process group", "tests/distributed"))
    yield seen
    if seen:  # also when the test caught the RuntimeError
        pytest.fail(seen[0], pytrace=False)
