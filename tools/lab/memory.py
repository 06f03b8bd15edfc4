"""Per-rank peak memory of training steps against sequence length (``tools.bench_memory``).

Every point runs ``usp.train.phase_runner.train`` itself (model, FSDP2, AdamW, the loss and
the memory features as the trainer applies them) for ``steps`` steps and reads the last
one, when the optimizer state exists before the step begins. The trainer's per-step
memory probe (``PeakMemory``, started at the step start and read after the optimizer step)
is swapped for ``StepProbe`` while the run lasts, so the measured interval is exactly the
trainer's step: data, forward, loss, backward, clipping, optimizer step.

What a point reports, per rank (the busiest rank of the group: the largest ``peak``):

- ``peak``: on CPU, the most bytes held by live CPU tensor storages at any moment of the
  step (``LiveTensorTracker``), state included: the CPU analogue of CUDA's allocated peak.
  On CUDA, ``torch.cuda.max_memory_allocated`` of the step.
- ``before``: those bytes at the step start (parameter shards, optimizer state and what
  the loop still holds from the previous step); ``activations = peak - before``.
- ``rss``: CPU cross-check: the process's resident high-water mark during the step
  (VmHWM, reset at the step start) minus its resident size before the run built anything
  (after freed heap is returned to the system). It also counts what the tracker cannot
  see: allocator slack, scratch a kernel allocates and frees inside one op, gloo buffers.
"""

from __future__ import annotations

import ctypes
import gc
import time
import weakref
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from usp.compat import TorchDispatchMode
from usp.config import RunConfig

MIB = 2**20


class LiveTensorTracker(TorchDispatchMode):
    """Bytes held by live tensor storages on ``device_type``, and their peak.

    While active (``with tracker:``) every storage an aten op returns is registered with
    its size and dropped when freed (a weak reference to its ``UntypedStorage``, which
    lives exactly as long as the memory). Storage resizes are followed: ops that resize a
    tensor in place are re-read after the op, and ``UntypedStorage.resize_`` (which does
    not pass through the dispatcher; FSDP2 frees and re-allocates unsharded parameters
    with it) is wrapped while the tracker is active. Tensor subclasses (DTensor) count
    their inner tensors. Storages that existed before the tracker started are not
    counted. Not seen: scratch a kernel allocates and frees inside one op, memory that
    is not a tensor storage.
    """

    def __init__(self, device_type: str = "cpu"):
        super().__init__()
        self.device_type = device_type
        self.live = 0  # bytes
        self.peak = 0  # bytes, since construction or the last reset_peak()
        self._sizes: dict[int, int] = {}  # id(storage) -> bytes counted for it
        self._refs: dict[int, weakref.ref] = {}
        self._resize = None

    def reset_peak(self) -> None:
        self.peak = self.live

    def see(self, storage: torch.UntypedStorage) -> None:
        """Count ``storage`` (new, or resized since it was last seen)."""
        if storage.device.type != self.device_type:
            return
        key, n = id(storage), storage.nbytes()
        old = self._sizes.get(key)
        if old is None:
            self._refs[key] = weakref.ref(storage, partial(self._freed, key))
            old = 0
        self._sizes[key] = n
        self.live += n - old
        self.peak = max(self.peak, self.live)

    def _freed(self, key: int, _ref) -> None:
        self._refs.pop(key, None)
        self.live -= self._sizes.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in _tensors(out):
            for st in _storages(t):
                self.see(st)
        return out

    def __enter__(self):
        original = self._resize = torch.UntypedStorage.resize_

        def resize_(storage, size):
            result = original(storage, size)
            self.see(storage)
            return result

        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._resize
        return super().__exit__(*exc)


def _tensors(out) -> Iterator[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        yield out
    elif isinstance(out, (tuple, list)):
        for x in out:
            yield from _tensors(x)


def _storages(t: torch.Tensor) -> Iterator[torch.UntypedStorage]:
    if type(t) is not torch.Tensor and hasattr(t, "__tensor_flatten__"):  # DTensor & co.
        for name in t.__tensor_flatten__()[0]:
            inner = getattr(t, name)
            if isinstance(inner, torch.Tensor):
                yield from _storages(inner)
    elif t.device.type != "meta":
        yield t.untyped_storage()


def resident_bytes(status: str | Path = "/proc/self/status") -> int:
    """This process's resident set size (VmRSS) in bytes; 0 where procfs has none."""
    try:
        for line in Path(status).read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024  # "VmRSS:   123456 kB"
    except OSError:
        pass
    return 0


def _glibc():
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc
        return None


def return_free_heap() -> None:
    """Collect garbage and hand freed heap back to the system (glibc ``malloc_trim``), so
    the resident size afterwards is what is live."""
    gc.collect()
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


def settle_allocator(threshold: int = MIB) -> None:
    """glibc: serve every block of ``threshold`` bytes or more by its own mmap (a fixed
    threshold, not raised by frees), so a freed large buffer leaves the resident set at
    once and the RSS cross-check follows live memory; nothing elsewhere."""
    libc = _glibc()
    if libc is not None:
        libc.mallopt(-3, threshold)  # -3: M_MMAP_THRESHOLD


@dataclass
class StepMemory:
    """One step on one rank: bytes (see the module docstring) and the step's seconds."""

    before: int
    peak: int
    rss: int
    step_s: float
    rank: int = 0

    @property
    def activations(self) -> int:
        return self.peak - self.before


class StepProbe:
    """The trainer's ``memory_probe`` (``train(cfg, memory_probe=...)``): ``start()`` at the step start,
    ``peak_mb()`` at its end; appends a ``StepMemory`` per step to ``records``.

    ``tracker``: CPU runs (None: no tensor tracking, e.g. for timing); on CUDA the
    allocator's counters are read instead."""

    def __init__(self, device, tracker: LiveTensorTracker | None, rss_idle: int,
                 records: list[StepMemory]):
        from usp.train.metrics import PeakMemory

        self.device = torch.device(device)
        self.tracker, self.rss_idle, self.records = tracker, rss_idle, records
        self.cuda = self.device.type == "cuda"
        self._rss = None if self.cuda else PeakMemory(self.device)
        self.kind = "cuda_allocated" if self.cuda else "tensor_live"
        self._before, self._t0 = 0, 0.0

    def start(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
            self._before = torch.cuda.memory_allocated(self.device)
        else:
            self._rss.start()
            if self.tracker is not None:
                self.tracker.reset_peak()
                self._before = self.tracker.live
        self._t0 = time.perf_counter()

    def peak_mb(self) -> float:
        dt = time.perf_counter() - self._t0
        if self.cuda:
            peak, rss = torch.cuda.max_memory_allocated(self.device), 0
        else:
            peak = self.tracker.peak if self.tracker is not None else 0
            resettable = self._rss.kind == "rss_step"
            rss = int(self._rss.peak_mb() * MIB) - self.rss_idle if resettable else 0
        rank = dist.get_rank() if dist.is_initialized() else 0
        self.records.append(StepMemory(self._before, peak, rss, dt, rank))
        return peak / MIB


def measure_run(cfg: RunConfig, track: bool = True) -> list[StepMemory]:
    """Train ``cfg`` on this process group (collective: every rank calls it with the same
    ``cfg``) and return every step's record on the busiest rank (largest ``peak``, or the
    slowest step when ``track`` is False)."""
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" \
        else torch.device("cpu")
    return_free_heap()
    rss_idle = 0 if device.type == "cuda" else resident_bytes()
    records: list[StepMemory] = []
    tracker = LiveTensorTracker(device.type) if track and device.type == "cpu" else None
    from usp.train.phase_runner import train

    def probe(dev: torch.device) -> StepProbe:
        return StepProbe(dev, tracker, rss_idle, records)

    if tracker is None:
        train(cfg, memory_probe=probe)
    else:
        with tracker:
            train(cfg, memory_probe=probe)
    return_free_heap()
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, [asdict(r) for r in records])
    key = (lambda rs: rs[-1]["peak"]) if track else (lambda rs: rs[-1]["step_s"])
    return [StepMemory(**r) for r in max(every, key=key)]
