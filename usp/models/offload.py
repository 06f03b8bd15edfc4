"""Activation offload: the inputs that checkpointed blocks keep for backward go to host memory.

A checkpointed block keeps only its input [B, n, D] for backward; with many blocks these
inputs add up. ``ActivationOffload`` parks each one in host memory during forward (the
copy starts on a side stream and overlaps the next blocks' compute) and brings it back in
backward: when block i is recomputed it takes its input back and starts the copy of the
previous checkpointed block's input, which is recomputed next. Values are copied, never
converted, so gradients are bit-identical to keeping the inputs on the device.

The copies themselves are a ``Copier``: ``StreamCopier`` on CUDA (pinned host buffers, a
side stream, events); tests inject a plain one to check the bookkeeping on the CPU.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

import torch
from torch.utils.checkpoint import checkpoint


class Copier(Protocol):
    """Moves tensors between the compute device and the host."""

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        """Start copying device tensor ``t`` to the host; returns the host tensor."""

    def to_device(self, host: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, Any]:
        """Start copying ``host`` back; returns (device tensor, token for ``wait``)."""

    def wait(self, token: Any) -> None:
        """Make the compute stream wait until the copy that gave ``token`` is done."""

    def release(self, host: torch.Tensor) -> None:
        """``host`` is no longer needed (once the copies already issued are done)."""


class StreamCopier:
    """CUDA copies on a side stream into reusable pinned host buffers."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self._free: dict[tuple, list[torch.Tensor]] = {}  # (shape, dtype) -> pinned buffers

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        free = self._free.get((t.shape, t.dtype))
        host = free.pop() if free else torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        self.stream.wait_stream(torch.cuda.current_stream(t.device))  # t is computed
        with torch.cuda.stream(self.stream):
            host.copy_(t, non_blocking=True)
        t.record_stream(self.stream)  # t's memory is not reused before the copy ends
        return host

    def to_device(self, host: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, Any]:
        out = torch.empty(host.shape, dtype=host.dtype, device=device)  # compute stream's
        self.stream.wait_stream(torch.cuda.current_stream(device))  # out's memory is free
        with torch.cuda.stream(self.stream):
            out.copy_(host, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        return out, done

    def wait(self, token: Any) -> None:
        torch.cuda.current_stream(self.device).wait_event(token)

    def release(self, host: torch.Tensor) -> None:
        # the next copy into it is issued on the same stream, after the copies out of it
        self._free.setdefault((host.shape, host.dtype), []).append(host)


class Parked:
    """One checkpointed input: on the device during its block's forward, then on the host,
    then (prefetched) on the device again until its block's recompute takes it."""

    __slots__ = ("index", "device", "requires_grad", "live", "host", "fetched", "token")

    def __init__(self, index: int, t: torch.Tensor, host: torch.Tensor):
        self.index, self.device, self.requires_grad = index, t.device, t.requires_grad
        self.live: torch.Tensor | None = t  # the forward's own tensor, until its block ran
        self.host: torch.Tensor | None = host
        self.fetched: torch.Tensor | None = None
        self.token: Any = None


class ActivationOffload:
    """Parks checkpointed inputs with ``copier`` from forward to backward.

    ``begin()`` at the start of each forward; ``checkpoint(fn, x, *args)`` in place of
    ``torch.utils.checkpoint.checkpoint(fn, x, *args, use_reentrant=False)`` for a block
    whose input is ``x``. ``held()`` counts the inputs still holding memory (0 after a
    backward).
    """

    def __init__(self, copier: Copier):
        self.copier = copier
        self._parked: list[Parked] = []

    def begin(self) -> None:
        """A new forward: forget the previous one's inputs."""
        self._parked = []

    def checkpoint(self, fn: Callable[..., torch.Tensor], x: torch.Tensor,
                   *args) -> torch.Tensor:
        """``fn(x, *args)`` checkpointed, with ``x`` parked on the host until backward."""
        parked = Parked(len(self._parked), x, self.copier.to_host(x.detach()))
        self._parked.append(parked)
        out = checkpoint(self._run, fn, parked, *args, use_reentrant=False)
        parked.live = None  # forward is done with it: the host copy is what backward gets
        return out

    def _run(self, fn, parked: Parked, *args) -> torch.Tensor:
        return fn(self.take(parked), *args)

    def take(self, parked: Parked) -> torch.Tensor:
        """The input of ``parked``'s block: its own tensor in forward; in the recompute the
        copy brought back (then the previous block's input starts coming back)."""
        if parked.live is not None:
            return parked.live
        if parked.fetched is None:
            if parked.host is None:
                raise RuntimeError("activation offload: this block's input was already taken "
                                   "by an earlier backward; a second backward through the "
                                   "same graph (retain_graph) is not supported with offload")
            self._prefetch(parked)
        self.copier.wait(parked.token)
        t, parked.fetched, parked.token = parked.fetched, None, None
        if parked.index > 0:  # the block recomputed next in backward
            self._prefetch(self._parked[parked.index - 1])
        return t.requires_grad_(parked.requires_grad)

    def _prefetch(self, parked: Parked) -> None:
        if parked.host is None or parked.fetched is not None:
            return
        parked.fetched, parked.token = self.copier.to_device(parked.host, parked.device)
        self.copier.release(parked.host)
        parked.host = None

    def held(self) -> int:
        """Parked inputs still holding a host or device copy."""
        return sum(p.host is not None or p.fetched is not None or p.live is not None
                   for p in self._parked)
