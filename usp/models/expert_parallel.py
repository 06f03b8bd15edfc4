"""Expert parallelism: a sparse layer's experts spread over the ranks of an expert group.

``parallel.expert_degree=N`` cuts the W = dp x ring x ulysses ranks into W/N expert groups of
N ranks, consecutive in the mesh's [dp, ring, ulysses] order (ulysses innermost: a group
sits inside a node while N <= ranks per node under ``placement=ulysses_inner``). Rank j of a
group holds experts [j E/N, (j+1) E/N) of every sparse layer; each expert's weights are
FSDP-sharded over the W/N ranks that hold the same experts (the other groups' rank j),
the rest of the model over all W ranks as with N = 1.

A block (``usp.models.moe.MoeBlock``; placed by ``usp.models.expert_placement``) routes its own tokens and puts their n*k rows in expert
order (``dispatch``) as without expert parallelism; ``ExpertGroup.run`` replaces running
them through every expert:

    rows [n*k, D] (expert order)  --all-to-all-->  [m, D] (by source rank, then expert)
    regroup by local expert -> the E/N local experts -> back to (source, expert) order
    --all-to-all (the splits reversed)-->  [n*k, D] in the order they left

Both exchanges are differentiable (``_AllToAll``: backward sends the gradients the way the
rows came), so a token's gradient reaches its own rank. Every row meets the same expert
weights as in one process: the result is exact, up to the order of floating-point sums
within an expert's matmul.

Gradients: each rank's loss is scaled by W so that FSDP's average over all W ranks is the
exact sum (``usp.models.tiling``); a local expert's gradient already sums the rows of the N
ranks of its group, so it is scaled by 1/N (``Experts.grad_scale``) before FSDP averages it
over the W/N ranks that hold the same experts. (Not FSDP's ``set_gradient_divide_factor``:
torch 2.13 divides twice by it where that group has one rank and the gradients are fp64.)
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ..comm import CommStats, on_wire
from ..comm.stats import tensor_bytes

AXIS = "expert"  # CommStats' axis of the expert exchanges

class _AllToAll(torch.autograd.Function):
    """rows [sum(send), D] -> [sum(recv), D]: ``send[p]`` rows to rank p of ``group``,
    ``recv[p]`` from it; backward sends the gradients back the same way."""

    @staticmethod
    def forward(ctx, rows, send: list[int], recv: list[int], group, stats):
        ctx.send, ctx.recv, ctx.group, ctx.stats = send, recv, group, stats
        return _exchange(rows, send, recv, group, stats)

    @staticmethod
    def backward(ctx, grad):
        return _exchange(grad, ctx.recv, ctx.send, ctx.group, ctx.stats), None, None, None, None


def _exchange(rows: torch.Tensor, send: list[int], recv: list[int], group,
              stats: CommStats | None) -> torch.Tensor:
    device = rows.device
    rows = on_wire(rows.contiguous(), group)  # gloo: CUDA rows staged through the host
    out = rows.new_empty((sum(recv), *rows.shape[1:]))
    me = dist.get_rank(group)
    row_bytes = rows[:1].numel() * rows.element_size()
    # timed on the clock of where the exchange runs (the host copy when staged)
    with _timed(stats, (sum(send) - send[me]) * row_bytes, rows.device):  # what leaves
        dist.all_to_all_single(out, rows, output_split_sizes=recv, input_split_sizes=send,
                               group=group)
    return out.to(device)


@contextmanager
def _timed(stats: CommStats | None, nbytes: int, device):
    """Record ``nbytes`` sent and the time blocked on the ``expert`` axis of ``stats``."""
    if stats is None:
        yield
        return
    stats.record(AXIS, nbytes)
    with stats.timed(AXIS, device):
        yield


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale: float):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


def scale_grad(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x itself; its gradient times ``scale``."""
    return _ScaleGrad.apply(x, scale)


def local_tensor(p: torch.Tensor) -> torch.Tensor:
    """This rank's part of an expert weight: a ``DTensor`` split over the expert group gives
    its local [E/N, ...] experts (differentiably), a plain tensor is all of them."""
    return p.to_local() if isinstance(p, DTensor) else p


@dataclass
class ExpertGroup:
    """One sparse layer's view of its expert group: ``group`` (N ranks), ``size`` N, ``index``
    (this rank's place in it), ``n_experts`` E; this rank holds experts [first, first +
    local). ``stats``: where the exchanges (rows out and back, forward and backward, and the
    row counts) record their bytes sent and the time this rank was blocked in them."""

    group: dist.ProcessGroup
    size: int
    index: int
    n_experts: int
    stats: CommStats | None = None  # the exchanges' bytes and blocked time, axis "expert"

    @property
    def local(self) -> int:
        return self.n_experts // self.size

    @property
    def first(self) -> int:
        return self.index * self.local

    def run(self, experts, rows: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """rows [n*k, D] in expert order (``sizes[e]`` rows for expert e, all E) -> [n*k, D],
        each row through its expert, wherever it lives."""
        send_counts = on_wire(torch.tensor(sizes, dtype=torch.int64, device=rows.device),
                              self.group).view(self.size, self.local)  # NCCL: on the device
        recv_counts = torch.empty_like(send_counts)  # [N source, E/N local expert]
        with _timed(self.stats, tensor_bytes(send_counts), send_counts.device):
            dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        recv_counts = recv_counts.cpu()  # the one host sync
        send = [sum(sizes[p * self.local:(p + 1) * self.local]) for p in range(self.size)]
        recv = recv_counts.sum(1).tolist()
        got = _AllToAll.apply(rows, send, recv, self.group, self.stats)  # by source, expert
        order = _by_expert(recv_counts).to(rows.device)
        out = experts(got[order], recv_counts.sum(0).tolist())  # through the local experts
        back = torch.empty_like(order)
        back[order] = torch.arange(order.numel(), device=order.device)
        return _AllToAll.apply(out[back], recv, send, self.group, self.stats)  # as they left


def _by_expert(counts: torch.Tensor) -> torch.Tensor:
    """The rows received, ``counts[s, e]`` from source s for local expert e in (source,
    expert) order, as indices that put them in (expert, source) order."""
    starts = (counts.reshape(-1).cumsum(0) - counts.reshape(-1)).view(counts.shape)
    parts = [torch.arange(int(starts[s, e]), int(starts[s, e] + counts[s, e]))
             for e in range(counts.shape[1]) for s in range(counts.shape[0])]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)
