"""wandb's helper processes (``usp/train/wandb_procs.py``): found by their executable's folder,
ended by group once logging closes, a helper that ignores SIGTERM too, and nothing else.

A copy of ``sleep`` in a folder of the test stands in for wandb's ``bin/wandb-symon``; the
real service and monitor under a real preemption are tests/e2e/test_wandb_preemption.py."""

import os
import shutil
import signal
import subprocess
import sys
import types
from pathlib import Path

import pytest

from usp.config import LoggingConfig
from usp.train.metrics import MetricsLogger
from usp.train.wandb_procs import helper_groups, live_helpers, stop_helpers

SLEEP = shutil.which("sleep")


@pytest.fixture
def fake_bin(tmp_path) -> Path:
    """A wandb package folder with ``bin/wandb-symon``, a copy of ``sleep``."""
    bin_dir = tmp_path / "wandb" / "bin"
    bin_dir.mkdir(parents=True)
    shutil.copy(SLEEP, bin_dir / "wandb-symon")
    return bin_dir


@pytest.fixture
def procs():
    """Processes the test starts; every one is killed and reaped at the end."""
    started: list[subprocess.Popen] = []
    yield started
    for p in started:
        if p.poll() is None:
            p.kill()
        p.wait()


def _start(procs, argv, **kw) -> subprocess.Popen:
    procs.append(subprocess.Popen(argv, **kw))
    return procs[-1]


def _ignore_sigterm():
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # kept across exec: the helper ignores it


def test_helpers_are_found_by_their_folder_and_grouped(fake_bin, procs):
    helper = _start(procs, [fake_bin / "wandb-symon", "30"], start_new_session=True)
    other = _start(procs, [SLEEP, "30"], start_new_session=True)  # a child, not wandb's
    assert helper_groups(os.getpid(), fake_bin) == {helper.pid}  # its own session's group
    assert live_helpers({helper.pid, other.pid}, fake_bin) == [helper.pid]


def test_stop_ends_the_helpers_and_nothing_else_in_their_group(fake_bin, procs):
    stubborn = _start(procs, [fake_bin / "wandb-symon", "30"], process_group=0,
                      preexec_fn=_ignore_sigterm)  # a group of its own
    neighbour = _start(procs, [SLEEP, "30"], process_group=stubborn.pid)  # in that group
    groups = helper_groups(os.getpid(), fake_bin)
    assert stop_helpers(groups, fake_bin, wait_s=0.2) == [stubborn.pid]
    assert stubborn.wait(timeout=5) == -signal.SIGKILL  # SIGTERM ignored: killed after 0.2 s
    assert neighbour.poll() is None  # same group, another executable: left alone
    assert stop_helpers(groups, fake_bin) == []  # nothing left: nothing signalled


def test_a_lost_service_leaves_no_monitor_behind(tmp_path, fake_bin, procs, monkeypatch, capsys):
    """wandb's init starts the monitor; the service dies (the log fails): the warning comes
    once and the monitor is gone by then, not when its own timer would notice."""
    monitor: list[subprocess.Popen] = []

    class Run:
        def log(self, values, step):
            if step > 1:
                raise ConnectionResetError("service gone")

        def finish(self):
            pass

    wandb = types.ModuleType("wandb")
    wandb.__file__ = str(fake_bin.parent / "__init__.py")
    wandb.init = lambda **kw: monitor.append(_start(
        procs, [fake_bin / "wandb-symon", "30"], start_new_session=True)) or Run()
    wandb.teardown = lambda: None
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    logger = MetricsLogger(LoggingConfig(wandb="offline", plot=False, progress=False),
                           tmp_path, rank=0, run_config={})
    logger.log({"step": 1, "loss": 1.0})
    assert monitor[0].poll() is None  # a healthy run keeps its monitor
    logger.log({"step": 2, "loss": 0.5})
    assert monitor[0].wait(timeout=5) == -signal.SIGTERM
    assert sum("wandb failed" in ln for ln in capsys.readouterr().err.splitlines()) == 1
    logger.close()
