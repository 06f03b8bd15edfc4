"""wandb's helper processes, found when logging starts and ended when it closes.

``wandb.init`` starts ``wandb-core`` (the service) in a session and process group of its own,
and from wandb 0.31 the service starts ``wandb-symon`` (its system monitor) inside that group.
``finish`` and ``teardown`` end both while the service is alive. When the service has died
first (Slurm's ``scancel`` and preemption signal every process of a step, the service among
them), the monitor is orphaned and lives on until its own timer notices that its parent pid
has gone, seconds after this process exits: a job step that is not over. So the logger
remembers the helpers' process groups and, once wandb is done or dead, ends what is left of
them itself, by signal, never waiting on a helper's timer.

A process counts as a helper only while its executable lies in wandb's own ``bin`` folder, so a
recycled pid or group id never leads to signalling anything else.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

# How long the helpers get to go after SIGTERM before SIGKILL; they exit in milliseconds.
TERM_WAIT_S = 0.5


def wandb_bin_dir() -> Path | None:
    """The folder of wandb's helper executables (``wandb-core``, ``wandb-symon``); None
    without an installed wandb."""
    try:
        import wandb
    except ImportError:
        return None
    where = getattr(wandb, "__file__", None)
    return Path(where).resolve().parent / "bin" if where else None


def _stat(pid: int) -> tuple[int, int, str] | None:
    """(parent pid, process group, state) of ``pid``; None when it is gone."""
    try:
        after_name = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return int(after_name[1]), int(after_name[2]), after_name[0]  # state ppid pgrp ...


def _is_helper(pid: int, bin_dir: Path) -> bool:
    try:
        exe = Path(os.readlink(f"/proc/{pid}/exe"))
    except OSError:  # gone, a zombie, or not ours to read
        return False
    return exe.parent == bin_dir


def _pids() -> list[int]:
    try:
        return [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return []


def helper_groups(root: int, bin_dir: Path) -> set[int]:
    """The process groups of wandb's helpers among the descendants of process ``root``."""
    stats = {pid: st for pid in _pids() if (st := _stat(pid)) is not None}
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in stats.items():
        children.setdefault(ppid, []).append(pid)
    groups, todo = set(), list(children.get(root, []))
    while todo:
        pid = todo.pop()
        todo.extend(children.get(pid, []))
        if _is_helper(pid, bin_dir):
            groups.add(stats[pid][1])
    return groups


def live_helpers(groups: set[int], bin_dir: Path) -> list[int]:
    """The live wandb helpers in ``groups``, wherever they were reparented."""
    if not groups:
        return []
    return sorted(pid for pid in _pids()
                  if (st := _stat(pid)) is not None and st[1] in groups and st[2] != "Z"
                  and _is_helper(pid, bin_dir))


def stop_helpers(groups: set[int], bin_dir: Path, wait_s: float = TERM_WAIT_S) -> list[int]:
    """End every live wandb helper in ``groups``: SIGTERM, then SIGKILL for any still alive
    after ``wait_s``. Returns the pids that were signalled (none when wandb closed cleanly)."""
    found = left = live_helpers(groups, bin_dir)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in left:
            try:
                os.kill(pid, sig)
            except OSError:
                pass
        deadline = time.monotonic() + wait_s
        while left and time.monotonic() < deadline:
            time.sleep(0.02)
            left = live_helpers(groups, bin_dir)
        if not left:
            break
    return found


class WandbHelpers:
    """The process groups of the wandb helpers a process started, to end what is left of them."""

    def __init__(self, groups: set[int] = frozenset(), bin_dir: Path | None = None):
        self.groups, self.bin_dir = set(groups), bin_dir

    @classmethod
    def started_by(cls, pid: int) -> WandbHelpers:
        """Those among the descendants of ``pid`` now (call it once ``wandb.init`` returned)."""
        bin_dir = wandb_bin_dir()
        return cls(helper_groups(pid, bin_dir), bin_dir) if bin_dir is not None else cls()

    def stop(self) -> list[int]:
        """End those still alive (none after a clean finish); the pids signalled."""
        if not self.groups:
            return []
        stopped = stop_helpers(self.groups, self.bin_dir)
        self.groups = set()
        return stopped
