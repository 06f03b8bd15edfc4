"""The process-tree memory sampler of ``tools.bench_prepare`` against a fake /proc: it finds
descendants through the parent pid in ``stat``, sums them, and leaves out what vanished."""

from pathlib import Path

from tools.lab.proctree import Memory, process_memory, tree_memory, tree_pids

KIB = 1024


def _process(proc: Path, pid: int, ppid: int, rss_kib: int | None = None,
             anon_kib: int = 0, pss_kib: int | None = None, comm: str = "python") -> None:
    d = proc / str(pid)
    d.mkdir(parents=True)
    # comm may hold spaces and parentheses: the parser cuts at the last ")"
    (d / "stat").write_text(f"{pid} ({comm}) S {ppid} {pid} {pid} 0 -1 4194560 0 0\n")
    if rss_kib is not None:
        (d / "status").write_text(f"Name:\t{comm}\nState:\tS (sleeping)\nPPid:\t{ppid}\n"
                                  f"VmPeak:\t  999999 kB\nVmRSS:\t  {rss_kib} kB\n"
                                  f"RssAnon:\t  {anon_kib} kB\nRssFile:\t  1 kB\n")
    if pss_kib is not None:
        (d / "smaps_rollup").write_text(f"00400000-7fff0000 ---p 00000000 00:00 0  [rollup]\n"
                                        f"Rss:\t{rss_kib} kB\nPss:\t{pss_kib} kB\n"
                                        f"Pss_Anon:\t1 kB\n")


def _fake_proc(tmp_path: Path) -> Path:
    proc = tmp_path / "proc"
    _process(proc, 100, 1, rss_kib=1000, anon_kib=600, pss_kib=800)  # the command
    _process(proc, 101, 100, rss_kib=300, anon_kib=200, pss_kib=150, comm="a (b) c")  # child
    _process(proc, 205, 101, rss_kib=50, anon_kib=40, pss_kib=25)  # grandchild
    _process(proc, 102, 100)  # a child that ended between its stat and its status
    _process(proc, 300, 1, rss_kib=7000, anon_kib=7000, pss_kib=7000)  # not in the tree
    _process(proc, 301, 300, rss_kib=9000, anon_kib=9000, pss_kib=9000)  # nor its child
    (proc / "self").mkdir()  # what is not a pid is no process
    (proc / "meminfo").write_text("MemTotal: 1 kB\n")
    (proc / "999").mkdir()  # vanished before its stat was read
    return proc


def test_the_tree_is_found_through_the_parent_pids(tmp_path):
    proc = _fake_proc(tmp_path)
    assert tree_pids(100, proc) == [100, 101, 102, 205]
    assert tree_pids(205, proc) == [205]


def test_a_parent_and_a_grandchild_are_summed_and_vanished_processes_skipped(tmp_path):
    proc = _fake_proc(tmp_path)
    total = tree_memory(100, proc)
    assert total == Memory(rss=(1000 + 300 + 50) * KIB, anon=(600 + 200 + 40) * KIB,
                           pss=(800 + 150 + 25) * KIB)
    assert process_memory(102, proc) == Memory()  # no status: gone (or a zombie)
    assert process_memory(4242, proc) == Memory()


def test_a_missing_smaps_rollup_leaves_pss_zero(tmp_path):
    proc = tmp_path / "proc"
    _process(proc, 7, 1, rss_kib=64, anon_kib=32)
    assert process_memory(7, proc) == Memory(rss=64 * KIB, anon=32 * KIB, pss=0)


def test_the_peak_is_kept_per_figure():
    a, b = Memory(rss=10, anon=5, pss=1), Memory(rss=3, anon=8, pss=2)
    assert a.peak(b) == Memory(rss=10, anon=8, pss=2)
    assert a + b == Memory(rss=13, anon=13, pss=3)
