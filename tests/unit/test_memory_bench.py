"""The memory benchmark: the live-tensor tracker counts exactly, the longest-fit search
brackets, the report's last line. A measured run on ranks:
``distributed/test_memory_bench_ranks.py``."""

import pytest
import torch

from tools.lab.memory import LiveTensorTracker, StepMemory, StepProbe
from tools.lab.memory_report import deviation, report
from tools.lab.memory_sweep import MemoryBench, Point, Sweep, bracket, longest_fit

F32 = 4


def test_tracker_counts_storages_exactly():
    tracker = LiveTensorTracker()
    with tracker:
        a = torch.empty(1000)  # 4000 bytes
        b = torch.zeros(250, dtype=torch.float64)  # 2000 bytes
        view = a.view(10, 100)  # the same storage: nothing new
        assert (tracker.live, tracker.peak) == (6000, 6000)
        del a
        assert tracker.live == 6000  # the view keeps the storage
        del view
        assert tracker.live == 2000
        c = b * 2  # a temporary of 2000 bytes
        del c
        assert (tracker.live, tracker.peak) == (2000, 6000)
        tracker.reset_peak()
        assert tracker.peak == 2000
        s = torch.empty(100).untyped_storage()  # 400 bytes
        s.resize_(0)  # as FSDP2 frees an unsharded parameter
        assert tracker.live == 2000
        s.resize_(800)
        assert (tracker.live, tracker.peak) == (2800, 2800)
        x = torch.ones(100, requires_grad=True)  # 400
        y = x.exp()  # 400, saved by exp's backward
        loss = (y * 3).sum()  # the product (400) is freed at once; the sum is 4 bytes
        del y
        assert tracker.live == 2800 + 400 + 400 + 4  # autograd holds exp's result
        loss.backward()  # frees the graph, x.grad (400) stays
        assert tracker.live == 2800 + 400 + 4 + 400
        assert tracker.peak >= 2800 + 400 + 400 + 4 + 400  # the product or a grad on top
    assert tracker.live == 2000 + 800 + 400 + 4 + 400  # b, s, x, loss, x.grad
    del x, loss, b, s
    assert tracker.live == 0  # frees after the tracker exits still count


def test_tracker_restores_storage_resize():
    original = torch.UntypedStorage.resize_
    with LiveTensorTracker():
        assert torch.UntypedStorage.resize_ is not original
    assert torch.UntypedStorage.resize_ is original


def test_step_probe_records_before_and_peak():
    tracker, records = LiveTensorTracker(), []
    with tracker:
        held = torch.empty(256)  # 1 KiB live before the step
        probe = StepProbe("cpu", tracker, 0, records)
        probe.start()
        tmp = torch.empty(1024)  # 4 KiB during the step
        del tmp
        probe.peak_mb()
    assert (records[0].before, records[0].peak, records[0].activations) == (1024, 5120, 4096)
    del held


def test_longest_fit_bisects_to_the_resolution():
    seen = []

    def measure(n):  # a step: fits up to 700 tokens
        seen.append(n)
        return 10 if n <= 700 else 20

    assert longest_fit(measure, 15, (256, 512, 1024), 64) == (640, 704)
    assert seen == [256, 512, 1024, 768, 640, 704]
    seen.clear()  # to within half the fitting length: stops after one midpoint
    assert longest_fit(measure, 15, (256, 512, 1024), 64, relative=0.5) == (512, 768)
    assert seen == [256, 512, 1024, 768]
    # a linear curve: the fit is within one resolution of the exact crossing (1000 + 3n = 5000)
    fit, over = longest_fit(lambda n: 1000 + 3 * n, 5000, (128, 1024, 2048), 32)
    assert fit <= 4000 / 3 < over and over - fit <= 32
    with pytest.raises(ValueError, match="every length"):
        longest_fit(lambda n: 1, 5, (2, 4), 2)
    with pytest.raises(ValueError, match="shortest length 2"):
        longest_fit(lambda n: 9, 5, (2, 4), 2)


def test_bracket_from_measured_lengths():
    peaks = {512: 30, 128: 10, 256: 20, 1024: 40}
    assert bracket(peaks, 25) == (256, 512)
    assert bracket(peaks, 20) == (256, 512)  # at the budget still fits
    assert "no measured length is over" in bracket(peaks, 40)
    assert "shortest measured length 128" in bracket(peaks, 5)


def test_bench_refuses_bad_settings():
    with pytest.raises(ValueError, match="even"):
        MemoryBench(lengths=(64, 129))
    with pytest.raises(ValueError, match="include baseline and optimized"):
        MemoryBench(features=("off", "baseline"))
    with pytest.raises(ValueError, match="ulysses 2 x ring"):
        MemoryBench(weak_ranks=(3,))


def test_deviation():
    assert deviation([90, 100, 110]) == pytest.approx(0.1)
    assert deviation([5, 5]) == 0


def _point(name, n, peak, timed=False):
    return Point(name, n, 2, 2, StepMemory(before=100 * 2**20, peak=peak * 2**20, rss=0,
                                           step_s=1.0 + n / 1000), timed)


def test_report_last_line_and_missing_bracket():
    bench = MemoryBench(vocab_size=1000, lengths=(64, 128, 256), budget_mib=150,
                        features=("baseline", "optimized"))
    points = [_point("baseline", 64, 140), _point("baseline", 128, 160),
              _point("optimized", 128, 120), _point("optimized", 256, 155),
              _point("baseline", 64, 0, timed=True), _point("optimized", 64, 0, timed=True)]
    sweep = Sweep(points, {"baseline": (64, 128), "optimized": (128, 256)})
    lines = report(bench, sweep)
    assert lines[-1] == "max_seq_len_per_rank baseline=64 optimized=128 ratio=2.00"
    assert any("fits at 128 (120.0 MiB), not at 256 (155.0 MiB)" in ln for ln in lines)
    sweep.longest["optimized"] = "every length of [64, 128, 256] fits"
    lines = report(bench, sweep)
    assert not lines[-1].startswith("max_seq_len_per_rank")
    assert any("no bracket: every length" in ln for ln in lines)
