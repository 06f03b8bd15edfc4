"""A command's wall time and peak memory, the memory summed over its whole process tree.

``run_sampled`` starts a command and, every ``interval`` seconds until it ends, sums the
resident memory of the command's process and all its descendants (found through
``/proc/<pid>/stat``'s parent pid): ``VmRSS`` (everything resident, file-backed pages such as
memory-mapped files included) and ``RssAnon`` (the process's own heap, what a file's page
cache does not explain) from ``/proc/<pid>/status``, and ``Pss`` from
``/proc/<pid>/smaps_rollup``. The peak of each is the largest sum seen.

Caveats: in a summed RSS (or RssAnon) the pages a forked child still shares with its parent
count once per process (spawned processes share nothing); the summed PSS counts them once.
A peak shorter than ``interval`` can be missed. Linux only (procfs).
"""

from __future__ import annotations

import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

PROC = "/proc"
INTERVAL_S = 0.1


def parent_pids(proc: str | Path = PROC) -> dict[int, int]:
    """{pid: parent pid} of every process under ``proc``; one that vanishes while it is
    read is left out."""
    parents = {}
    for entry in os.scandir(proc):
        if not entry.name.isdigit():
            continue
        try:
            with open(os.path.join(entry.path, "stat")) as f:
                stat = f.read()
        except OSError:  # ended between the listing and the read
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so cut at the last ")"
        fields = stat.rsplit(")", 1)[-1].split()
        if len(fields) > 1:
            parents[int(entry.name)] = int(fields[1])
    return parents


def tree_pids(root: int, proc: str | Path = PROC) -> list[int]:
    """``root`` and all its descendants (breadth first), from one scan of ``proc``."""
    children: dict[int, list[int]] = {}
    for pid, ppid in parent_pids(proc).items():
        children.setdefault(ppid, []).append(pid)
    found, queue = [], [root]
    while queue:
        pid = queue.pop(0)
        found.append(pid)
        queue.extend(sorted(children.get(pid, ())))
    return found


@dataclass(frozen=True)
class Memory:
    """Resident bytes: ``rss`` (VmRSS, file-backed pages such as mapped files included),
    ``anon`` (RssAnon: the process's own heap and stacks), ``pss`` (Pss: each page divided by
    the processes sharing it, so a forked tree's shared pages count once in the sum)."""

    rss: int = 0
    anon: int = 0
    pss: int = 0

    def __add__(self, other: "Memory") -> "Memory":
        return Memory(self.rss + other.rss, self.anon + other.anon, self.pss + other.pss)

    def peak(self, other: "Memory") -> "Memory":
        """The larger of each figure (a peak kept per figure)."""
        return Memory(max(self.rss, other.rss), max(self.anon, other.anon),
                      max(self.pss, other.pss))


def _kib_fields(path: str, names: dict[str, str]) -> dict[str, int]:
    """{key: bytes} for the ``Name:   123 kB`` lines of ``path`` named in ``names``
    ({line name: key}); {} for a file that is gone."""
    found = {}
    try:
        with open(path) as f:
            for line in f:
                name = line.split(":", 1)[0]
                if name in names:
                    found[names[name]] = int(line.split()[1]) * 1024  # "VmRSS:   123456 kB"
    except (OSError, ValueError, IndexError):
        return {}
    return found


def process_memory(pid: int, proc: str | Path = PROC) -> Memory:
    """``pid``'s ``Memory`` (from ``status`` and ``smaps_rollup``); zeros for a process that
    is gone or a zombie (no such lines)."""
    base = os.path.join(proc, str(pid))
    status = _kib_fields(os.path.join(base, "status"), {"VmRSS": "rss", "RssAnon": "anon"})
    if not status:
        return Memory()
    return Memory(**status, **_kib_fields(os.path.join(base, "smaps_rollup"), {"Pss": "pss"}))


def tree_memory(root: int, proc: str | Path = PROC) -> Memory:
    """``Memory`` summed over ``root``'s process tree."""
    total = Memory()
    for pid in tree_pids(root, proc):
        total = total + process_memory(pid, proc)
    return total


@dataclass
class Sampled:
    """One command's run: exit status, wall seconds, the peak of its tree's summed
    ``Memory``, and the peak as it stood when ``mark`` first held (None: it never did)."""

    rc: int
    seconds: float
    peak: Memory
    mark_peak: Memory | None = None


def run_sampled(cmd: list[str], *, env: dict | None = None, cwd: str | Path | None = None,
                stdout: Path | None = None, interval: float = INTERVAL_S,
                mark: Callable[[], bool] | None = None, timeout: float | None = None,
                proc: str | Path = PROC) -> Sampled:
    """Run ``cmd`` to its end, sampling its process tree's memory every ``interval`` s.

    ``stdout``: a file for the command's stdout and stderr (else discarded). ``mark()`` is
    asked at every sample until it first returns True; the peaks then are kept apart (the
    peak of a first phase). ``timeout``: the command is killed after so many seconds and
    the run has rc -9."""
    out = open(stdout, "wb") if stdout is not None else subprocess.DEVNULL
    peak = Memory()
    marked: Memory | None = None
    child = None
    try:
        t0 = time.perf_counter()
        child = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT)
        while True:
            rc = child.poll()
            if rc is not None:
                break
            peak = peak.peak(tree_memory(child.pid, proc))
            if marked is None and mark is not None and mark():
                marked = peak
            if timeout is not None and time.perf_counter() - t0 > timeout:
                child.kill()
                child.wait()
                rc = -9
                break
            try:
                rc = child.wait(interval)
                break
            except subprocess.TimeoutExpired:
                pass
        seconds = time.perf_counter() - t0
    finally:
        if child is not None and child.poll() is None:  # interrupted: leave nothing running
            child.kill()
            child.wait()
        if stdout is not None:
            out.close()
    if marked is None and mark is not None and mark():  # the phase ended between samples
        marked = peak
    return Sampled(rc, seconds, peak, marked)
