"""The ulysses all-to-all: the seq <-> head exchange as one ``all_to_all_single``, or one
per fragment when messages are cut, blocking or in flight (``InFlight``) while the caller
computes. Every call records the bytes this rank sends to other ranks (``CommStats``)."""

from __future__ import annotations

import time
from functools import lru_cache
from typing import Callable

import torch
import torch.distributed as dist

from ..dims.counts import even_counts
from .stats import CommStats, clock_for, tensor_bytes
from .wire import naming_collectives, on_wire


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

    fragments = fragment_count(tensor_bytes(wire) // n, fragment_bytes)
    return post_all_to_all(wire, torch.empty_like(wire), group, stats, axis,
                           tensor_bytes(wire) * (n - 1) // n, finish, fragments=fragments)


def all_to_all(x: torch.Tensor, group: dist.ProcessGroup | None,
               to_group_rank: list[int] | None, stats: CommStats,
               axis: str = "ulysses") -> torch.Tensor:
    """``all_to_all_start(...).wait()``: the blocking exchange (``x`` returned when n == 1)."""
    if x.shape[0] == 1:
        return x
    return all_to_all_start(x, group, to_group_rank, stats, axis).wait()
