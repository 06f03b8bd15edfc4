"""What the trainer does on a GPU, checked on CPU in one process: the CUDA RNG in
checkpoints, a peak-memory figure that belongs to one step, the layout's device. bf16 mixed
precision under FSDP2: ``distributed/test_train_gpu_contract_ranks.py``."""

from types import SimpleNamespace

import pytest
import torch

from usp.models import checkpoint
from usp.train.metrics import PeakMemory
from usp.train.trainer import _device


# --- defect 11: the CUDA RNG state saved in a checkpoint is restored ---

class _FakeCudaRng:
    def __init__(self, state: bytes):
        self.state, self.set_calls = torch.tensor(list(state), dtype=torch.uint8), []

    def install(self, monkeypatch, available=True):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
        monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device="cuda": self.state.clone())
        monkeypatch.setattr(torch.cuda, "set_rng_state",
                            lambda new_state, device="cuda": self.set_calls.append(new_state))


def test_cuda_rng_state_is_saved_and_restored(tmp_path, monkeypatch):
    cuda = _FakeCudaRng(bytes(range(7, 23)))
    cuda.install(monkeypatch)
    checkpoint.save_rng(tmp_path / "rng.pt")
    expect_cpu = torch.rand(4)  # the draws a resumed run must repeat
    checkpoint.load_rng(tmp_path / "rng.pt")
    assert len(cuda.set_calls) == 1
    assert bytes(cuda.set_calls[0].tolist()) == bytes(range(7, 23))
    assert torch.equal(torch.rand(4), expect_cpu)


def test_cuda_rng_state_is_skipped_without_cuda(tmp_path, monkeypatch):
    cuda = _FakeCudaRng(b"\x01\x02\x03")
    cuda.install(monkeypatch)
    checkpoint.save_rng(tmp_path / "rng.pt")  # written on a GPU machine
    cuda.install(monkeypatch, available=False)  # resumed on CPU
    checkpoint.load_rng(tmp_path / "rng.pt")
    assert cuda.set_calls == []


# --- defect 13: peak memory is per step ---

def test_peak_rss_is_per_step():
    mem = PeakMemory("cpu")
    if mem.kind != "rss_step":
        pytest.skip("this kernel refuses to reset the RSS high-water mark (/proc/self/clear_refs)")
    mb = 256
    mem.start()
    buf = torch.ones(mb * 2**20, dtype=torch.uint8)  # every page touched
    big = mem.peak_mb()
    del buf  # a large block goes back to the OS
    mem.start()
    small = mem.peak_mb()
    assert big - small >= 0.9 * mb, (big, small)


def test_peak_rss_reads_a_fake_procfs(tmp_path):
    (tmp_path / "clear_refs").write_text("")
    (tmp_path / "status").write_text("Name:\tpython\nVmHWM:\t  524288 kB\nVmRSS:\t  1024 kB\n")
    mem = PeakMemory("cpu", proc=tmp_path)
    assert mem.kind == "rss_step"
    (tmp_path / "clear_refs").write_text("")
    mem.start()
    assert (tmp_path / "clear_refs").read_text() == "5"
    assert mem.peak_mb() == 512.0


def test_peak_rss_falls_back_when_reset_is_refused(tmp_path):
    mem = PeakMemory("cpu", proc=tmp_path)  # no clear_refs here
    assert mem.kind == "rss_since_start"
    assert not (tmp_path / "clear_refs").exists()  # probing never creates it
    mem.start()
    assert mem.peak_mb() > 0


def test_peak_cuda_is_reset_each_step(monkeypatch):
    calls, alloc = [], {"now": 0, "peak": 0}

    def reset(device):
        calls.append(("reset", device))
        alloc["peak"] = alloc["now"]

    def malloc(n):
        alloc["now"] += n
        alloc["peak"] = max(alloc["peak"], alloc["now"])

    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", reset)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device: alloc["peak"])
    dev = torch.device("cuda", 1)
    mem = PeakMemory(dev)
    assert mem.kind == "cuda_allocated"
    malloc(2**30)  # live before the step: part of its peak, as on a real device
    mem.start()
    malloc(3 * 2**30)
    malloc(-3 * 2**30)
    assert mem.peak_mb() == 4 * 1024
    mem.start()
    malloc(2**20)
    assert mem.peak_mb() == 1024 + 1
    assert calls == [("reset", dev), ("reset", dev)]


# --- the trainer computes on the layout's device, not on one it re-derives ---

def test_the_trainer_takes_the_layouts_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert _device(SimpleNamespace(device="cuda")) == torch.device("cuda", 3)
    assert _device(SimpleNamespace(device="cpu")) == torch.device("cpu")
