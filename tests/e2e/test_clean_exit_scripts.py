"""A clean exit of real scripts: the library example under torchrun, and a script that never
closes its meshes (``tests/no_close_script.py``, 4 ranks) whose meshes are released at
interpreter exit, before the shutdown starts.

Gloo worker threads that outlive ``dist.destroy_process_group()`` into the interpreter's
shutdown can abort it ("terminate called without an active exception"); see the comment
above ``SPMesh.close``.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from usp.launch import free_port

ROOT = Path(__file__).resolve().parents[2]
NO_CLOSE_SCRIPT = ROOT / "tests" / "no_close_script.py"


@pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun not on PATH")
def test_library_example_exits_cleanly(tmp_path):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_"))}
    cmd = ["torchrun", "--standalone", "--nproc-per-node", "4",
           str(ROOT / "examples" / "library_example.py")]
    # One launch (~8 s on 2 cores; five were run before). The exit is asserted
    # deterministically rather than by repeating a race: distributed/test_clean_exit.py (close
    # and ``with`` leave only the default group's gloo workers) and the test below (no worker
    # alive at the last atexit handler after ``dist.destroy_process_group()``).
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, env=env,
                         timeout=300, check=False)
    assert "terminate called" not in res.stderr, res.stderr[-3000:]
    assert res.returncode == 0, res.stderr[-3000:]
    assert "matches dense attention" in res.stdout, res.stdout


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts threads in /proc")
def test_unclosed_mesh_is_released_before_interpreter_shutdown(tmp_path):
    # 4 ranks of a script that never closes its two meshes and ends with only
    # dist.destroy_process_group(); its last atexit handler (the last Python code before
    # finalization) must find every gloo worker joined and both meshes released. Before
    # the release at exit: 8-10 workers per rank and the kept mesh open, every run.
    world, port = 4, free_port()
    base = {k: v for k, v in os.environ.items()
            if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_"))}
    base.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world),
                OMP_NUM_THREADS="1",
                PYTHONPATH=os.pathsep.join(filter(None, (str(ROOT),
                                                         base.get("PYTHONPATH")))))
    procs = [subprocess.Popen([sys.executable, str(NO_CLOSE_SCRIPT)], cwd=tmp_path,
                              env={**base, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(world)]
    results = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=240)
            results.append((p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for rank, (rc, out, err) in enumerate(results):
        assert "terminate called" not in err, (rank, err[-3000:])
        assert rc == 0, (rank, rc, err[-3000:])
        check = [line for line in out.splitlines() if line.startswith("exit-check")]
        assert check, (rank, out, err[-3000:])
        fields = dict(f.split("=") for f in check[-1].split()[1:])
        assert fields["workers"] == "0", (rank, check[-1])
        assert fields["kept"] == "closed", (rank, check[-1])
        assert fields["local"] in ("gone", "closed"), (rank, check[-1])
