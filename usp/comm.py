"""The two communication mechanisms of usp, with byte and time accounting.

- ``all_to_all`` / ``post_all_to_all``: the ulysses seq <-> head exchange (one
  ``all_to_all_single``, or one per fragment when messages are cut), blocking or in flight
  (``InFlight``) while the caller computes.
- ``RingComm``: send to the next ring rank, receive from the previous one (or any fixed
  distance round the ring), via ``batch_isend_irecv`` on the ring's own group (or, for a
  message cut into fragments, an exchange per fragment on that group), so the transfer runs
  while the caller computes.

Every call records the bytes this rank *sends to other ranks* in ``CommStats``, per axis,
and the seconds it spent blocked (``exposed_s``), so tests can assert volumes and the
trainer can report the share of time in communication. An all-to-all left in flight also
records how long it travelled while the caller computed instead of waiting (``hidden_s``).

Transport: gloo carries CPU tensors only. When a CUDA tensor meets a gloo group (several
processes sharing one GPU in a check), it travels through a CPU copy; CPU tensors and
NCCL are untouched (``stage_through_host``).
"""

from __future__ import annotations

import re
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Callable

import torch
import torch.distributed as dist

from .dims.counts import even_counts


def clock_for(device: torch.device | str) -> str:
    """The clock that times a blocking call on ``device``: ``cuda_events`` or ``host``.

    NCCL calls and ``Work.wait()`` return to the host once the work is queued, so on CUDA
    only events on the current stream see how long the computation waited.
    """
    return "cuda_events" if torch.device(device).type == "cuda" else "host"


@dataclass
class CommStats:
    """Bytes sent, calls and blocked seconds per mesh axis (``ulysses``, ``ring``, ``sp``...),
    and the ring's local kernel calls per (``"forward"``/``"backward"``, ring step).

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
        self._seconds.clear()
        self._pending.clear()
        self.hidden_s.clear()

    def total_seconds(self) -> float:
        return float(sum(self.seconds.values()))


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def stage_through_host(device_type: str, backend: str) -> bool:
    """Whether a tensor on ``device_type`` must travel through a CPU copy on ``backend``.

    ``backend`` is ``dist.get_backend(group)``: one name ("gloo", "nccl") or a per-device
    list ("cpu:gloo,cuda:nccl"). True only for a non-CPU tensor whose device is served by
    gloo (or by nothing, when CPU's backend is gloo), which moves CPU memory only.
    """
    if device_type == "cpu":
        return False
    if ":" in backend:
        per_device = dict(part.split(":", 1) for part in backend.split(","))
        backend = per_device.get(device_type, per_device.get("cpu", ""))
    return backend == "gloo"


def on_wire(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """``x`` as ``group``'s backend can carry it: a CPU copy when it must be staged, else ``x``."""
    if stage_through_host(x.device.type, dist.get_backend(group)):
        return x.to("cpu", copy=True)
    return x


@lru_cache(maxsize=64)
def _permutation(to_group_rank: tuple[int, ...], device: torch.device):
    """(coordinate -> group rank, group rank -> coordinate) gather indices on ``device``.

    Built once per permutation and device: an index made from a Python list on every call
    would be a blocking host-to-device copy on CUDA.
    """
    inv = [0] * len(to_group_rank)
    for c, g in enumerate(to_group_rank):
        inv[g] = c
    return (torch.tensor(inv, dtype=torch.long, device=device),
            torch.tensor(to_group_rank, dtype=torch.long, device=device))


PEER_LOST = re.compile(r"timed out|connection (closed|reset|refused)|broken pipe", re.I)


def collective_error(err: BaseException, axis: str, ranks: list[int]) -> BaseException:
    """``err`` from a collective on ``axis`` over global ``ranks``, renamed when it means a
    peer never answered (gloo: "Timed out waiting 3000ms for recv operation to complete") or
    went away ("Connection closed by peer"); any other error is returned unchanged."""
    text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    if not isinstance(err, RuntimeError) or not PEER_LOST.search(text):
        return err
    if text.startswith("collective on "):  # already named by an inner naming_collectives
        return err
    ms = re.search(r"(\d+)\s*ms", text)
    waited = f" after {int(ms.group(1)) / 1000:g}s" if ms else ""
    what = "timed out" if "timed out" in text.lower() else "lost a peer"
    me = dist.get_rank() if dist.is_initialized() else "?"
    return RuntimeError(
        f"collective on {axis} ranks {ranks} {what}{waited} on rank {me}: a peer did not "
        f"answer (hung or dead; the launcher names the ranks still running); raise "
        f"trainer.timeout_s if that collective is legitimately slow [{text}]")


@contextmanager
def naming_collectives(axis: str, group: dist.ProcessGroup | None = None):
    """Run collectives on ``axis`` (``group``; None = the world) so that a timeout or a lost
    peer raises an error naming the axis and its global ranks (see ``collective_error``)."""
    try:
        yield
    except RuntimeError as e:
        ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
        named = collective_error(e, axis, ranks)
        if named is e:
            raise
        raise named from e


def check_agreement(what: str, value, group: dist.ProcessGroup | None = None) -> None:
    """Collective over ``group``: raise ``ValueError`` on every rank unless all pass the same
    ``value`` (any picklable, compared with ``==``), naming which ranks passed what.

    Different arguments per rank otherwise hang (mismatched groups) or silently compute
    something else (a different ``causal``); one small all-gather of objects catches it.
    """
    values = [None] * dist.get_world_size(group)
    dist.all_gather_object(values, value, group=group)
    if all(v == values[0] for v in values):
        return
    ranks = dist.get_process_group_ranks(group) if group is not None else range(len(values))
    by_value: dict[str, list[int]] = {}
    for r, v in zip(ranks, values):
        by_value.setdefault(repr(v), []).append(r)
    raise ValueError(f"ranks disagree on {what}: "
                     + "; ".join(f"ranks {rs}: {v}" for v, rs in by_value.items())
                     + "; every rank must pass the same arguments")


class InFlight:
    """An all-to-all posted with ``async_op=True`` (one work, or one per fragment): ``wait()``
    blocks until every fragment has landed (timed as exposed on ``stats``), then returns
    ``finish(received)``.

    On the host clock, callbacks on the works' futures note when the last fragment landed, so
    ``wait`` can add the time the exchange travelled unobserved to ``stats.hidden_s``.
    """

    def __init__(self, works, send: torch.Tensor | list[torch.Tensor], received: torch.Tensor,
                 stats: CommStats, axis: str, group,
                 finish: Callable[[torch.Tensor], torch.Tensor]):
        self._works = works if isinstance(works, list) else [works]
        self._received, self._finish = received, finish
        self._send = send  # alive until the transfer has read it
        self._stats, self._axis, self._group = stats, axis, group
        self._posted, self._landings = time.perf_counter(), []
        self._host = clock_for(received.device) == "host"
        if self._host:
            for work in self._works:
                work.get_future().add_done_callback(self._landed)

    def _landed(self, _future) -> None:  # on a gloo thread: list.append is atomic
        self._landings.append(time.perf_counter())

    def wait(self) -> torch.Tensor:
        waited = time.perf_counter()
        with self._stats.timed(self._axis, self._received.device), \
                naming_collectives(self._axis, self._group):
            for work in self._works:
                work.wait()
        self._send = None
        if self._host:  # in flight while the caller did something else
            done = max(self._landings) if len(self._landings) == len(self._works) else None
            landed = waited if done is None else min(waited, done)
            self._stats.hidden_s[self._axis] += max(0.0, landed - self._posted)
        return self._finish(self._received)


# The largest fragment of a ulysses or ring message to one peer where the axis's groups
# cross hosts over gloo (``SPMesh.build``'s ``fragment_bytes="auto"``). On the simulated
# cluster's 300 mbit link a two-way exchange ran at 26 ms per MiB in 0.25 MiB messages and
# at 48-52 ms per MiB in 1.5-3 MiB ones (docs/measurements.md).
GLOO_FRAGMENT_BYTES = 256 * 1024


def fragment_count(block_bytes: int, fragment_bytes: int | None) -> int:
    """Fragments of at most ``fragment_bytes`` that a message of ``block_bytes`` to one peer is
    cut into (1: sent whole; ``fragment_bytes`` None or 0: never cut)."""
    if not fragment_bytes or block_bytes <= fragment_bytes:
        return 1
    return -(-block_bytes // fragment_bytes)


def post_all_to_all(send: torch.Tensor, received: torch.Tensor, group, stats: CommStats,
                    axis: str, nbytes: int, finish: Callable[[torch.Tensor], torch.Tensor],
                    recv_sizes: list[int] | None = None,
                    send_sizes: list[int] | None = None, fragments: int = 1) -> InFlight:
    """Post ``all_to_all_single(received, send, recv_sizes, send_sizes)`` on ``group`` without
    waiting, recording ``nbytes`` sent to other ranks on ``axis``; ``finish`` maps the
    received buffer to the result ``wait()`` returns.

    ``fragments > 1`` cuts every peer's block into that many runs and posts one all-to-all per
    run, back to back (``calls`` counts each; the bytes are the same): on gloo over a slow
    TCP link, a two-way exchange of a large message runs well under the link rate, and the
    same bytes in messages of a few hundred KiB run near it (docs/performance.md). Every
    rank of the group must pass the same ``fragments``.
    """
    if fragments == 1:
        with naming_collectives(axis, group):
            work = dist.all_to_all_single(received, send, recv_sizes, send_sizes, group=group,
                                          async_op=True)
        stats.record(axis, nbytes)
        return InFlight(work, send, received, stats, axis, group, finish)
    n = dist.get_world_size(group)
    if send_sizes is None:  # equal blocks: [n, F] rows, one column run per fragment
        sends = [run.contiguous() for run in send.reshape(n, -1).tensor_split(fragments, dim=1)]
        recvs = [torch.empty_like(s) for s in sends]

        def gather(out: torch.Tensor) -> torch.Tensor:  # [n, F] from the fragments' columns
            torch.cat(recvs, dim=1, out=out.view(n, -1))
            return out
        sizes = [(None, None)] * fragments
    else:  # 1-D with per-peer sizes: run i of every peer's block goes in fragment i
        send_cuts = [even_counts(m, fragments) for m in send_sizes]  # [peer][fragment]
        recv_cuts = [even_counts(m, fragments) for m in recv_sizes]
        by_peer = [block.split(cuts) for block, cuts in zip(send.split(send_sizes), send_cuts)]
        sends = [torch.cat([runs[i] for runs in by_peer]) for i in range(fragments)]
        sizes = [([c[i] for c in recv_cuts], [c[i] for c in send_cuts]) for i in range(fragments)]
        recvs = [send.new_empty(sum(r)) for r, _ in sizes]

        def gather(out: torch.Tensor) -> torch.Tensor:  # peer blocks from their runs
            runs = [r.split(rs) for r, (rs, _) in zip(recvs, sizes)]  # [fragment][peer]
            for j, block in enumerate(out.split(recv_sizes)):
                torch.cat([runs[i][j] for i in range(fragments)], out=block)
            return out
    works = []
    with naming_collectives(axis, group):
        for s, r, (rs, ss) in zip(sends, recvs, sizes):
            works.append(dist.all_to_all_single(r, s, rs, ss, group=group, async_op=True))
    for m in even_counts(nbytes, fragments):  # the same bytes, one call per fragment
        stats.record(axis, m)
    return InFlight(works, sends, received, stats, axis, group, lambda out: finish(gather(out)))


def all_to_all_start(
    x: torch.Tensor,
    group: dist.ProcessGroup | None,
    to_group_rank: list[int] | None,
    stats: CommStats,
    axis: str = "ulysses",
    fragment_bytes: int | None = None,
) -> InFlight:
    """Post the exchange of chunk ``c`` of dim 0 with the rank at axis coordinate ``c``.

    ``x``: [n, ...] where n is the group size (n > 1); chunk c is sent to coordinate c.
    ``wait()`` returns [n, ...] where chunk c came from coordinate c. ``to_group_rank[c]``
    maps a mesh coordinate to the group's rank when they differ (process groups order
    members by global rank; the mesh may not), else None. ``fragment_bytes``: send each
    chunk in fragments of at most that many bytes (``post_all_to_all``); None: whole.
    """
    n, device = x.shape[0], x.device
    perm = None
    if to_group_rank is not None:  # [n(coordinate), ...] -> [n(group rank), ...]
        perm = _permutation(tuple(to_group_rank), device)
        x = x.index_select(0, perm[0])
    wire = on_wire(x.contiguous(), group)

    def finish(out: torch.Tensor) -> torch.Tensor:
        out = out.to(device)  # back from the host copy when staged, else a no-op
        # [n(group rank), ...] -> [n(coordinate), ...]
        return out if perm is None else out.index_select(0, perm[1])

    fragments = fragment_count(_nbytes(wire) // n, fragment_bytes)
    return post_all_to_all(wire, torch.empty_like(wire), group, stats, axis,
                           _nbytes(wire) * (n - 1) // n, finish, fragments=fragments)


def all_to_all(x: torch.Tensor, group: dist.ProcessGroup | None,
               to_group_rank: list[int] | None, stats: CommStats,
               axis: str = "ulysses") -> torch.Tensor:
    """``all_to_all_start(...).wait()``: the blocking exchange (``x`` returned when n == 1)."""
    if x.shape[0] == 1:
        return x
    return all_to_all_start(x, group, to_group_rank, stats, axis).wait()


class RingComm:
    """Point-to-point ring on ``group``: ``ranks`` are the ring's global ranks in ring order
    and this rank is ``ranks[index]``.

    Peers are global ranks (``P2POp`` maps them into ``group``); ``group`` is the ring's
    own process group, so ring traffic does not queue behind other collectives.

    ``fragment_bytes``: a message larger than that travels as an exchange on ``group`` in
    fragments of at most that size (``post_all_to_all``, every other peer's block empty), so
    that at most the fragments gloo has in flight queue on the link at once; every rank of the
    ring must pass the same value. None: one send and one receive.
    """

    def __init__(self, ranks: list[int], index: int, group, stats: CommStats,
                 axis: str = "ring", fragment_bytes: int | None = None):
        self.ranks, self.index, self.group = list(ranks), index, group
        self.stats, self.axis, self.fragment_bytes = stats, axis, fragment_bytes

    def start(self, send: torch.Tensor, tag: int = 0, shift: int = 1):
        """Post the send of ``send`` to the rank ``shift`` places on and the receive of an
        equally shaped block from the rank ``shift`` places back; returns a handle whose
        ``wait()`` gives the received block."""
        device = send.device
        send = on_wire(send.contiguous(), self.group)
        n = len(self.ranks)
        to, frm = self.ranks[(self.index + shift) % n], self.ranks[(self.index - shift) % n]
        fragments = fragment_count(_nbytes(send), self.fragment_bytes)
        if fragments > 1:  # [numel] to ``to`` only, [numel] from ``frm`` only, in fragments
            send_sizes, recv_sizes = [0] * n, [0] * n
            send_sizes[dist.get_group_rank(self.group, to)] = send.numel()
            recv_sizes[dist.get_group_rank(self.group, frm)] = send.numel()
            shape = send.shape
            return post_all_to_all(send.reshape(-1), torch.empty_like(send).reshape(-1),
                                   self.group, self.stats, self.axis, _nbytes(send),
                                   lambda out: out.view(shape).to(device), recv_sizes,
                                   send_sizes, fragments=fragments)
        recv = torch.empty_like(send)
        ops = [dist.P2POp(dist.isend, send, to, self.group, tag),
               dist.P2POp(dist.irecv, recv, frm, self.group, tag)]
        reqs = dist.batch_isend_irecv(ops)
        self.stats.record(self.axis, _nbytes(send))
        return _Pending(reqs, send, recv, device, self)


class _Pending:
    def __init__(self, reqs, send, recv, device, comm: RingComm):
        self._reqs, self._send, self.recv, self._device, self._comm = reqs, send, recv, device, comm

    def wait(self) -> torch.Tensor:
        comm = self._comm
        with comm.stats.timed(comm.axis, self.recv.device), naming_collectives(comm.axis, comm.group):
            for r in self._reqs:
                r.wait()
        self._send = None  # the send buffer may be freed now
        return self.recv.to(self._device)  # back from the host copy when staged
