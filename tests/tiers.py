"""The test tiers: a test file's folder under ``tests/`` is its tier, and ``conftest.py`` gives
each of its tests that marker.

    unit         one process, no process group, no Python subprocess (checked while it runs)
    distributed  gloo process groups: ranks spawned by ``spawn_local``/``run_local``/torchrun
    e2e          a user's command in a subprocess: ``usp-train``/``usp-plan``, a tool, an example
    root         a simulated cluster (``tools.simcluster``: root, ip, tc, unshare)
    slurm        a real Slurm cluster (``tools.slurmcluster``: root, slurm-wlm, munge); skipped
                 with the reason without them
    gpu          needs CUDA; skipped with the reason on a machine without it

Each tier is one command, ``python -m pytest -q tests/<tier>``. ``fast`` marks every unit
test plus the distributed tests in ``FAST``: the quick run, ``python -m pytest -q -m fast``.
A test file directly in ``tests/`` or in a folder that is no tier stops the collection with
an error naming it. Helpers shared by several tiers sit directly in ``tests/`` (``_cases.py``,
``fakes_*.py``, ...); ``conftest.py`` puts that folder on ``sys.path``.
"""

from __future__ import annotations

from pathlib import PurePosixPath

UNIT, DISTRIBUTED, E2E, ROOT, SLURM, GPU = "unit", "distributed", "e2e", "root", "slurm", "gpu"
NAMES = (UNIT, DISTRIBUTED, E2E, ROOT, SLURM, GPU)

# Distributed tests in the fast selection: 2-10 s each on 2 cores, and between them every
# mechanism (mesh, layout, all-to-all + ring parity, agreement, byte counts, close, eval).
# A key is a file under tests/ (every test in it) or ``file::function`` (every parametrisation).
FAST: frozenset[str] = frozenset({
    "distributed/test_agreement.py",
    "distributed/test_attention_parity.py::test_parity",
    "distributed/test_attention_parity.py::test_bad_shapes_raise_before_any_collective",
    "distributed/test_clean_exit.py::test_close_frees_groups_and_refuses_use",
    "distributed/test_comm_volume.py",
    "distributed/test_evaluate.py",
    "distributed/test_mesh_layout.py",
})


def tier_of(file: str) -> str | None:
    """The tier of a test file from its path under ``tests/`` (``unit/test_cli.py`` -> unit);
    None for a file directly in ``tests/`` or under a folder that is no tier."""
    parts = PurePosixPath(file).parts
    return parts[0] if len(parts) > 1 and parts[0] in NAMES else None


def is_fast(file: str, function: str, tier: str) -> bool:
    return tier == UNIT or f"{file}::{function}" in FAST or file in FAST


def misplaced(files: list[str]) -> str:
    """The collection error for test files outside the tier folders."""
    folders = ", ".join(f"tests/{name}" for name in NAMES)
    return (f"{', '.join(files)}: in no test tier; move each test file into the folder of its "
            f"tier: {folders} (see tests/tiers.py)")
