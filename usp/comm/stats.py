"""Byte and time accounting of every collective: ``CommStats``, per mesh axis."""

from __future__ import annotations

import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable

import torch


def clock_for(device: torch.device | str) -> str:
    """The clock that times a blocking call on ``device``: ``cuda_events`` or ``host``.

    NCCL calls and ``Work.wait()`` return to the host once the work is queued, so on CUDA
    only events on the current stream see how long the computation waited.
    """
    return "cuda_events" if torch.device(device).type == "cuda" else "host"


@dataclass
class CommStats:
    """Bytes sent, calls and blocked seconds per mesh axis (``ulysses``, ``ring``, ``sp``...),
    and the ring's local kernel calls per (``"forward"``/``"backward"``, ring step), with
    the (query, key) pairs those calls compute (``kernel_pairs``, per batch row and head:
    ``usp.masks.piece_pairs``), the attention work a rank did at each step, and the ring
    steps a row's documents left empty for every rank (``hops_dropped``, per phase).

    ``seconds`` (= ``exposed_s``) is the time the caller was blocked on an axis;
    ``hidden_s`` the time exchanges left in flight (``InFlight``: the ulysses all-to-alls,
    and ring messages cut into fragments; not the ring's plain P2P) travelled while the
    caller computed: from the post to the earlier of its completion and the caller's wait.
    Hidden time is measured on the host clock only (CPU tensors; on CUDA it stays 0).

    Seconds come from ``clock`` ("host": ``perf_counter`` around the call; "cuda_events":
    an event pair on the current stream around it). Event pairs are kept pending and
    resolved only when seconds are read (``seconds``, ``total_seconds()``), so timing
    never makes a call wait for the GPU. ``event_factory`` replaces ``torch.cuda.Event``
    (tests).
    """

    bytes: Counter = field(default_factory=Counter)
    calls: Counter = field(default_factory=Counter)
    clock: str = "host"
    event_factory: Callable | None = None
    kernel_calls: Counter = field(default_factory=Counter)
    kernel_pairs: Counter = field(default_factory=Counter)
    hops_dropped: Counter = field(default_factory=Counter)  # per phase: ring steps not made
    _seconds: Counter = field(default_factory=Counter, repr=False)
    hidden_s: Counter = field(default_factory=Counter)
    _pending: list = field(default_factory=list, repr=False)  # (axis, start, end) events

    @property
    def seconds(self) -> Counter:
        """Blocked seconds per axis (resolves pending CUDA event pairs first)."""
        for axis, start, end in self._pending:
            end.synchronize()  # waits for that span only, now that someone reads it
            self._seconds[axis] += start.elapsed_time(end) / 1e3  # ms -> s
        self._pending.clear()
        return self._seconds

    @property
    def exposed_s(self) -> Counter:
        """Blocked seconds per axis: communication the caller waited for (``seconds``)."""
        return self.seconds

    def record(self, axis: str, nbytes: int, seconds: float = 0.0) -> None:
        self.bytes[axis] += int(nbytes)
        self.calls[axis] += 1
        self._seconds[axis] += seconds

    @contextmanager
    def timed(self, axis: str, device: torch.device | str):
        """Add the time the block is blocked to ``axis``, on the clock ``device`` calls for."""
        self.clock = clock_for(device)
        if self.clock == "host":
            t0 = time.perf_counter()
            yield
            self._seconds[axis] += time.perf_counter() - t0
            return
        make = self.event_factory or torch.cuda.Event
        start = make(enable_timing=True)
        start.record()  # on the current stream: fires when the work queued before is done
        yield
        end = make(enable_timing=True)
        end.record()  # fires once the stream may go on, i.e. after the communication
        self._pending.append((axis, start, end))

    def reset(self) -> None:
        self.bytes.clear()
        self.calls.clear()
        self.kernel_calls.clear()
        self.kernel_pairs.clear()
        self.hops_dropped.clear()
        self._seconds.clear()
        self._pending.clear()
        self.hidden_s.clear()

    def total_seconds(self, skip: tuple[str, ...] = ()) -> float:
        """Blocked seconds of every axis but those in ``skip``."""
        return float(sum(v for axis, v in self.seconds.items() if axis not in skip))


def tensor_bytes(t: torch.Tensor) -> int:
    """The bytes of ``t``'s elements."""
    return t.numel() * t.element_size()
