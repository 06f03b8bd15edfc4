"""The ring's point-to-point transport: ``RingComm`` sends to the next ring rank and receives
from the previous one (or any fixed distance round the ring), via ``batch_isend_irecv`` on
the ring's own group (or, for a message cut into fragments, an exchange per fragment on
that group), so the transfer runs while the caller computes."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .all_to_all import fragment_count, post_all_to_all
from .stats import CommStats, tensor_bytes
from .wire import naming_collectives, on_wire


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
        fragments = fragment_count(tensor_bytes(send), self.fragment_bytes)
        if fragments > 1:  # [numel] to ``to`` only, [numel] from ``frm`` only, in fragments
            send_sizes, recv_sizes = [0] * n, [0] * n
            send_sizes[dist.get_group_rank(self.group, to)] = send.numel()
            recv_sizes[dist.get_group_rank(self.group, frm)] = send.numel()
            shape = send.shape
            return post_all_to_all(send.reshape(-1), torch.empty_like(send).reshape(-1),
                                   self.group, self.stats, self.axis, tensor_bytes(send),
                                   lambda out: out.view(shape).to(device), recv_sizes,
                                   send_sizes, fragments=fragments)
        recv = torch.empty_like(send)
        ops = [dist.P2POp(dist.isend, send, to, self.group, tag),
               dist.P2POp(dist.irecv, recv, frm, self.group, tag)]
        reqs = dist.batch_isend_irecv(ops)
        self.stats.record(self.axis, tensor_bytes(send))
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
