"""The supervised local launch (``usp.launch.run_local``): a killed rank restarts ALL ranks,
a refusal is not retried, a signal to the launcher reaches every rank, a hung peer becomes an
error naming the ranks, and no rank process outlives its launcher. Plus torchrun restarts."""

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from usp.comm import CommStats, all_to_all
from usp.launch import run_local

ROOT = Path(__file__).resolve().parents[2]
TESTS = Path(__file__).resolve().parent


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")  # an unreaped zombie is gone too


def _start(out_dir: str) -> int:
    """Record this rank's pid for this attempt; returns the attempt (0, 1, ...)."""
    rank = dist.get_rank()
    attempt = len(list(Path(out_dir).glob(f"a*_r{rank}.pid")))
    Path(out_dir, f"a{attempt}_r{rank}.pid").write_text(str(os.getpid()))
    return attempt


def _pids(out_dir) -> list[int]:
    return [int(p.read_text()) for p in Path(out_dir).glob("a*_r*.pid")]


# ---- rank functions (module level: spawned ranks import them) ---------------------------------


def _killed_on_first_attempt(out_dir):
    attempt = _start(out_dir)
    t = torch.ones(1)
    dist.all_reduce(t)  # the group works on every attempt
    if attempt == 0 and dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()  # rank 0 of attempt 0 waits here for a peer that is gone
    Path(out_dir, f"done_a{attempt}_r{dist.get_rank()}").write_text(str(t.item()))


def _refuses(out_dir):
    _start(out_dir)
    if dist.get_rank() == 1:
        raise ValueError("data.seq_len=100 is not divisible by 4 ranks; use data.seq_len=128")
    dist.barrier()


class _Preempted(Exception):
    exit_code = 42  # what the trainer's preemption exception carries


def _waits_for_signal(out_dir):
    rank = dist.get_rank()
    _start(out_dir)

    def on_signal(signum, frame):
        Path(out_dir, f"sig_r{rank}").write_text(signal.Signals(signum).name)
        raise _Preempted()

    signal.signal(signal.SIGTERM, on_signal)
    # forked from the server that preloaded the trainer (this file never imports it)
    Path(out_dir, f"ready_r{rank}").write_text(str("usp.train.phase_runner" in sys.modules))
    time.sleep(60)


def _hangs_outside_collectives(out_dir):
    _start(out_dir)
    if dist.get_rank() == 1:
        time.sleep(60)  # never joins the all_reduce
    # usp's own all-to-all, as the ulysses exchange calls it: its errors name the axis
    all_to_all(torch.ones(2, 3), None, None, CommStats(), axis="ulysses")


def _launcher(fn_name: str, out_dirs: list[Path], **kw) -> subprocess.Popen:
    """One process, in a session of its own (signals are sent to it, or to its whole process
    group), that calls ``run_local`` once per folder of ``out_dirs`` in turn and writes each
    call's exit code to the folder's ``code``: one start-up of the launcher and of the server
    its ranks are forked from for several runs.

    The launcher and the ranks it spawns import this file as ``test_restarts`` from
    ``PYTHONPATH`` (the tests folder, then this checkout for ``usp``).
    """
    code = textwrap.dedent(f"""
        import pathlib
        import test_restarts as t
        from usp.launch import run_local
        for out_dir in {[str(d) for d in out_dirs]!r}:
            code = run_local(t.{fn_name}, 2, out_dir, threads=1, **{kw!r})
            pathlib.Path(out_dir, "code").write_text(str(code))
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), str(ROOT)])}
    return subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env,
                            start_new_session=True)


def _wait_for(paths, seconds=30.0):
    end = time.monotonic() + seconds
    while not all(p.exists() for p in paths):
        assert time.monotonic() < end, f"ranks never wrote {paths}"
        time.sleep(0.1)


# ---- tests ------------------------------------------------------------------------------------


def test_sigkilled_rank_restarts_all_ranks_and_leaves_none(tmp_path):
    lines = []
    code = run_local(_killed_on_first_attempt, 2, str(tmp_path), max_restarts=1, threads=1,
                     log=lines.append)
    assert code == 0
    assert sorted(p.name for p in tmp_path.glob("a*.pid")) == [
        "a0_r0.pid", "a0_r1.pid", "a1_r0.pid", "a1_r1.pid"]  # ALL ranks started again
    assert sorted(p.name for p in tmp_path.glob("done_*")) == ["done_a1_r0", "done_a1_r1"]
    assert len(lines) == 1 and "restart 1/1" in lines[0], lines
    assert "rank 1 was killed by SIGKILL" in lines[0], lines
    assert not [pid for pid in _pids(tmp_path) if _alive(pid)]


def test_without_restarts_the_failure_names_rank_and_signal(tmp_path):
    with pytest.raises(RuntimeError) as e:
        run_local(_killed_on_first_attempt, 2, str(tmp_path), max_restarts=0, threads=1)
    assert "rank 1 was killed by SIGKILL" in str(e.value)
    assert "trainer.max_restarts=0" in str(e.value)
    assert len(_pids(tmp_path)) == 2  # one attempt
    assert not [pid for pid in _pids(tmp_path) if _alive(pid)]  # rank 0 was not left waiting


def test_value_error_in_a_rank_is_refused_not_retried(tmp_path):
    with pytest.raises(ValueError, match="rank 1 refused: ValueError: data.seq_len=100"):
        run_local(_refuses, 2, str(tmp_path), max_restarts=2, threads=1)
    assert len(_pids(tmp_path)) == 2  # no second attempt
    assert not [pid for pid in _pids(tmp_path) if _alive(pid)]


@pytest.fixture(scope="module")
def signalled(tmp_path_factory) -> dict:
    """One launcher, three runs of two ranks that wait for a signal (``_launcher``): SIGTERM to
    the launcher alone ("launcher"), SIGTERM to its whole process group as a terminal or a
    scheduler sends it ("group"), then SIGKILL to the launcher ("killed"). name -> its folder;
    "alive": the ranks still alive after each run (10 s after the SIGKILL at most)."""
    tmp = tmp_path_factory.mktemp("signalled")
    dirs = {name: tmp / name for name in ("launcher", "group", "killed")}
    for d in dirs.values():
        d.mkdir()
    alive = {}
    proc = _launcher("_waits_for_signal", list(dirs.values()), max_restarts=1)
    try:
        for name, sig in (("launcher", None), ("group", signal.SIGTERM)):
            d = dirs[name]
            _wait_for([d / "ready_r0", d / "ready_r1"])
            if sig is None:
                proc.send_signal(signal.SIGTERM)
            else:
                os.killpg(proc.pid, sig)
            _wait_for([d / "code"])
            alive[name] = [pid for pid in _pids(d) if _alive(pid)]
        d = dirs["killed"]
        _wait_for([d / "ready_r0", d / "ready_r1"])
        proc.kill()  # SIGKILL: the launcher cannot clean up
        proc.wait(timeout=10)
        end = time.monotonic() + 10
        while [pid for pid in _pids(d) if _alive(pid)] and time.monotonic() < end:
            time.sleep(0.1)
        alive["killed"] = [pid for pid in _pids(d) if _alive(pid)]
    finally:
        if proc.poll() is None:
            proc.kill()
    return {**dirs, "alive": alive}


def test_sigterm_to_launcher_reaches_every_rank_and_its_code_is_returned(signalled):
    d = signalled["launcher"]
    assert (d / "code").read_text() == str(_Preempted.exit_code)  # the ranks' code, no restart
    assert [(d / f"sig_r{r}").read_text() for r in range(2)] == ["SIGTERM"] * 2
    assert len(_pids(d)) == 2
    assert not signalled["alive"]["launcher"]


def test_sigterm_to_every_process_of_the_job_still_returns_the_ranks_code(signalled):
    """A signal to the whole process group (a terminal's, a scheduler's) reaches the server
    the ranks were forked from too: it stays, so the launcher learns their exit code (and
    restarts nothing)."""
    d = signalled["group"]
    assert [(d / f"ready_r{r}").read_text() for r in range(2)] == ["True", "True"]  # forked
    assert (d / "code").read_text() == str(_Preempted.exit_code)
    assert [(d / f"sig_r{r}").read_text() for r in range(2)] == ["SIGTERM"] * 2
    assert len(_pids(d)) == 2  # no restart
    assert not signalled["alive"]["group"]


def test_killed_launcher_takes_its_ranks_with_it(signalled):
    assert len(_pids(signalled["killed"])) == 2
    assert not signalled["alive"]["killed"]


def test_collective_timeout_fails_fast_naming_the_ranks(tmp_path):
    t0 = time.monotonic()
    with pytest.raises(RuntimeError) as e:
        run_local(_hangs_outside_collectives, 2, str(tmp_path), timeout_s=3, threads=1)
    assert time.monotonic() - t0 < 25  # not the 60 s the hung rank sleeps
    msg = str(e.value)
    assert "rank 0 raised" in msg and "collective on ulysses ranks [0, 1] timed out after 3s" in msg
    assert "ranks [1] still running" in msg, msg
    assert not [pid for pid in _pids(tmp_path) if _alive(pid)]


TORCHRUN_SCRIPT = """
import os, sys, time
import torch, torch.distributed as dist
from usp.launch import init_from_env, launcher_env
info = launcher_env()
restart = os.environ["TORCHELASTIC_RESTART_COUNT"]
if restart == "1" and info["rank"] == 1:
    time.sleep(2)  # a restarted rank that starts late: its peer must not read attempt 0's address
init_from_env(info, "cpu", timeout_s=20)
t = torch.ones(1)
dist.all_reduce(t)
if restart == "0" and info["rank"] == 1:
    sys.exit(7)  # a lost rank: torchrun restarts both
dist.barrier()
open(os.path.join(sys.argv[1], f"done_{info['rank']}"), "w").write(str(t.item()))
dist.destroy_process_group()
"""


@pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun not on PATH")
def test_torchrun_max_restarts_rejoins_with_a_fresh_rendezvous(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(TORCHRUN_SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE"))}
    env["OMP_NUM_THREADS"], env["PYTHONPATH"] = "1", str(ROOT)  # this checkout's usp
    # torchrun's default (static) rendezvous: the agent's store outlives the first attempt
    res = subprocess.run(["torchrun", "--nproc-per-node", "2",
                          "--max-restarts", "1", str(script), str(tmp_path)],
                         env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr[-2000:]
    assert sorted(p.name for p in tmp_path.glob("done_*")) == ["done_0", "done_1"]
