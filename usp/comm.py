"""The two communication mechanisms of usp, with byte accounting.

- ``all_to_all``: the ulysses seq <-> head exchange (one ``all_to_all_single``).
- ``RingComm``: send to the next ring rank, receive from the previous one, via
  ``batch_isend_irecv`` so the transfer runs while the caller computes.

Every call records the bytes this rank *sends to other ranks* in ``CommStats``, per axis,
and the seconds it spent blocked, so tests can assert volumes and the trainer can report
the share of time in communication.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass
class CommStats:
    """Bytes sent, calls and blocked seconds per mesh axis (``ulysses``, ``ring``, ``sp``...)."""

    bytes: Counter = field(default_factory=Counter)
    calls: Counter = field(default_factory=Counter)
    seconds: Counter = field(default_factory=Counter)

    def record(self, axis: str, nbytes: int, seconds: float = 0.0) -> None:
        self.bytes[axis] += int(nbytes)
        self.calls[axis] += 1
        self.seconds[axis] += seconds

    def reset(self) -> None:
        self.bytes.clear()
        self.calls.clear()
        self.seconds.clear()

    def total_seconds(self) -> float:
        return float(sum(self.seconds.values()))


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def all_to_all(
    x: torch.Tensor,
    group: dist.ProcessGroup | None,
    to_group_rank: list[int] | None,
    stats: CommStats,
    axis: str = "ulysses",
) -> torch.Tensor:
    """Exchange chunk ``c`` of dim 0 with the rank at axis coordinate ``c``.

    ``x``: [n, ...] where n is the group size; chunk c is sent to coordinate c. Returns
    [n, ...] where chunk c came from coordinate c. ``to_group_rank[c]`` maps a mesh
    coordinate to the group's rank when they differ (process groups order members by
    global rank; the mesh may not), else None.
    """
    n = x.shape[0]
    if n == 1:
        return x
    if to_group_rank is not None:  # reorder coordinates -> group ranks
        inv = [0] * n
        for c, g in enumerate(to_group_rank):
            inv[g] = c
        x = x[inv]
    x = x.contiguous()
    out = torch.empty_like(x)
    t0 = time.perf_counter()
    dist.all_to_all_single(out, x, group=group)
    stats.record(axis, _nbytes(x) * (n - 1) // n, time.perf_counter() - t0)
    if to_group_rank is not None:  # group ranks -> coordinates
        out = out[to_group_rank]
    return out


class RingComm:
    """Point-to-point ring: send to ``next_rank``, receive from ``prev_rank`` (global ranks)."""

    def __init__(self, prev_rank: int, next_rank: int, group, stats: CommStats, axis: str = "ring"):
        self.prev_rank, self.next_rank, self.group = prev_rank, next_rank, group
        self.stats, self.axis = stats, axis

    def start(self, send: torch.Tensor, tag: int = 0) -> "_Pending":
        """Post the send of ``send`` and the receive of an equally shaped block; returns a handle."""
        send = send.contiguous()
        recv = torch.empty_like(send)
        ops = [
            dist.P2POp(dist.isend, send, self.next_rank, self.group, tag),
            dist.P2POp(dist.irecv, recv, self.prev_rank, self.group, tag),
        ]
        reqs = dist.batch_isend_irecv(ops)
        self.stats.record(self.axis, _nbytes(send))
        return _Pending(reqs, send, recv, self)


class _Pending:
    def __init__(self, reqs, send, recv, comm: RingComm):
        self._reqs, self._send, self.recv, self._comm = reqs, send, recv, comm

    def wait(self) -> torch.Tensor:
        t0 = time.perf_counter()
        for r in self._reqs:
            r.wait()
        self._comm.stats.seconds[self._comm.axis] += time.perf_counter() - t0
        self._send = None  # the send buffer may be freed now
        return self.recv
