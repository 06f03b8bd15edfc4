"""``spawn_local`` forks its ranks from a forkserver that preloaded usp's training path
(``usp.launch.starter``), yet each rank sees what a freshly spawned one would: the
launcher's environment, working directory and standard output and error as they are at the
call, and its own intra-op threads (a rank forked from a launcher that had used OpenMP
threads hangs when it uses more than one)."""

import os
import sys

import torch
import torch.distributed as dist

from usp.launch import spawn_local
from usp.launch.starter import PRELOAD, start_method


def _report(tag: str) -> None:
    rank = dist.get_rank()
    a = torch.randn(256, 256)
    (a @ a).sum().item()  # two OpenMP threads (threads=2 below)
    preloaded = all(m in sys.modules for m in PRELOAD)  # this module does not import them
    # one write a line: print's text and its newline are two writes, and the two ranks share
    # the stream, so their lines could interleave ("...Truerank 1 ...")
    _say(sys.stdout, f"rank {rank} out {tag} {os.environ.get('USP_TEST_MARK')} {os.getcwd()} "
                     f"threads={torch.get_num_threads()} preloaded={preloaded}")
    _say(sys.stderr, f"rank {rank} err {tag}")


def _say(stream, line: str) -> None:
    stream.write(line + "\n")
    stream.flush()


def _lines(text: str) -> list[str]:
    return sorted(ln for ln in text.splitlines() if ln.startswith("rank "))


def test_forked_ranks_see_the_launchers_environment_directory_and_streams(capfd, monkeypatch,
                                                                         tmp_path):
    assert start_method() == "forkserver"  # Linux
    torch.set_num_threads(2)
    (torch.randn(512, 512) @ torch.randn(512, 512)).sum().item()  # the launcher's own threads
    for i in range(2):  # the second call's ranks come from the same, already running server
        where = tmp_path / f"call{i}"
        where.mkdir()
        monkeypatch.chdir(where)
        monkeypatch.setenv("USP_TEST_MARK", f"mark{i}")
        spawn_local(_report, 2, f"call{i}", threads=2)
        out, err = capfd.readouterr()
        assert _lines(out) == [f"rank {r} out call{i} mark{i} {where} threads=2 preloaded=True"
                               for r in range(2)], out
        assert _lines(err) == [f"rank {r} err call{i}" for r in range(2)], err
    monkeypatch.delenv("USP_TEST_MARK")
    spawn_local(_report, 2, "unset", threads=2)
    assert all(" unset None " in ln for ln in _lines(capfd.readouterr().out))
