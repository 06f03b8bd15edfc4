"""Several ``usp-train`` / ``usp-plan`` command lines in one Python process (one start-up
instead of one per command), each with its own exit status, stdout and stderr.

Output is captured at the file descriptors, so what a rank it started would print is part
of its command's output; Hydra's global state is cleared between commands.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

_DRIVER = """
import json, os, sys, tempfile, traceback
from hydra.core.global_hydra import GlobalHydra
import usp.cli as cli

calls, results_path = json.loads(sys.argv[1]), sys.argv[2]
results = []
for entry, args in calls:
    sys.argv = [entry, *args]
    files = [tempfile.TemporaryFile(mode="w+") for _ in range(2)]
    saved = [os.dup(1), os.dup(2)]
    sys.stdout.flush(); sys.stderr.flush()
    for fd, f in zip((1, 2), files):
        os.dup2(f.fileno(), fd)
    try:
        getattr(cli, entry)()
        rc = 0
    except SystemExit as e:  # what the interpreter would make of it
        rc = e.code if isinstance(e.code, int) else (e.code is not None)
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
        rc = 1
    finally:
        sys.stdout.flush(); sys.stderr.flush()
        for fd, s in zip((1, 2), saved):
            os.dup2(s, fd)
            os.close(s)
        GlobalHydra.instance().clear()
    out, err = (f.seek(0) or f.read() for f in files)
    results.append({"returncode": int(rc), "stdout": out, "stderr": err})
with open(results_path, "w") as f:
    json.dump(results, f)
"""


def run_commands(calls: list[tuple[str, list[str]]], tmp_path: Path,
                 timeout: float = 300) -> list[subprocess.CompletedProcess]:
    """``calls``: (``train_main`` or ``plan_main``, its arguments) each; their results, in
    order, as ``CompletedProcess`` (returncode, stdout, stderr)."""
    results = Path(tmp_path) / "cli_results.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "SLURM"))}
    env["PYTHONUNBUFFERED"] = "1"
    subprocess.run([sys.executable, "-c", _DRIVER, json.dumps(calls), str(results)], cwd=ROOT,
                   env=env, check=True, timeout=timeout)
    return [subprocess.CompletedProcess([entry, *args], r["returncode"], r["stdout"], r["stderr"])
            for (entry, args), r in zip(calls, json.loads(results.read_text()))]
