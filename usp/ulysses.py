"""The ulysses all-to-all: "some tokens, all heads" <-> "all tokens of the segment, some heads".

Forward of attention uses ``SeqToHead`` (q, k, v in ONE fused all-to-all) and
``HeadToSeq`` (the output back). Each is the other's backward.

Heads: ulysses rank j computes the query heads ``head_split(Hq, Hkv, u).q_ranges[j]``
(``usp.dims.heads``) and receives exactly the KV heads those use (``kv_heads[j]``). When
the heads divide evenly that is Hq/u query heads and max(Hkv/u, 1) KV heads per rank;
otherwise the counts differ between ranks (6 heads on 4 ranks: 2, 2, 1, 1). A KV head used by several ranks is sent to
each of them (replicated only that far) and its gradients are summed on the way home.

Send buffers are packed per destination as contiguous blocks ([q-block | k-block |
v-block] for each rank). When every rank sends and receives equal blocks the buffer is
[u, ...] and each tensor packs with one copy (``comm.all_to_all``); otherwise blocks are
copied one by one and sent with uneven split sizes (``all_to_all_v_start``): no padding, so no
byte is sent that the receiver does not use.
"""

from __future__ import annotations

from functools import lru_cache
from math import prod

import torch
import torch.distributed as dist

from .comm import CommStats, InFlight, all_to_all_start, on_wire, fragment_count, post_all_to_all
from .dims.heads import HeadSplit, head_split


@lru_cache(maxsize=64)
def kv_send_index(split: HeadSplit, device: torch.device) -> torch.Tensor | None:
    """The KV heads sent to ranks 0..u-1, concatenated: LongTensor [sum kv_counts] on
    ``device``; None when that is 0..Hkv-1 (each KV head goes to one rank, in order).

    Built once per split and device: a fresh index on every call of every layer would be
    a blocking host-to-device copy on CUDA.
    """
    heads = [h for kv in split.kv_heads for h in kv]
    if heads == list(range(split.num_kv_heads)):
        return None
    return torch.tensor(heads, dtype=torch.long, device=device)


def all_to_all_v_start(send: torch.Tensor, send_sizes: list[int], recv_sizes: list[int],
                       group: dist.ProcessGroup | None, to_group_rank: list[int] | None,
                       stats: CommStats, axis: str = "ulysses",
                       fragment_bytes: int | None = None) -> InFlight:
    """Post an exchange of chunks of different sizes: ``send`` is 1-D, its chunk c
    (``send_sizes[c]`` elements, in coordinate order) goes to coordinate c. ``wait()``
    returns 1-D [sum recv_sizes], chunk c (``recv_sizes[c]`` elements) from coordinate c.
    ``to_group_rank`` as in ``comm.all_to_all``. Records the bytes sent to other ranks.
    ``fragment_bytes``: cut the exchange into fragments so that no chunk's fragment exceeds it
    (``comm.post_all_to_all``); every rank must then have the same largest chunk.
    """
    device = send.device
    if to_group_rank is not None:  # chunks in coordinate order -> in group-rank order
        by_rank = sorted(range(len(to_group_rank)), key=to_group_rank.__getitem__)
        chunks = send.split(send_sizes)
        send = torch.cat([chunks[c] for c in by_rank])
        send_sizes = [send_sizes[c] for c in by_rank]
        recv_sizes = [recv_sizes[c] for c in by_rank]
    wire = on_wire(send.contiguous(), group)
    own = send_sizes[dist.get_rank(group)]

    def finish(out: torch.Tensor) -> torch.Tensor:
        out = out.to(device)  # back from the host copy when staged, else a no-op
        if to_group_rank is not None:  # chunks in group-rank order -> in coordinate order
            chunks = out.split(recv_sizes)
            out = torch.cat([chunks[g] for g in to_group_rank])
        return out

    largest = max(*send_sizes, *recv_sizes) * wire.element_size()
    return post_all_to_all(wire, wire.new_empty(sum(recv_sizes)), group, stats, axis,
                           (wire.numel() - own) * wire.element_size(), finish,
                           recv_sizes, send_sizes,
                           fragments=fragment_count(largest, fragment_bytes))


class _Axis:
    """The ulysses group as the all-to-all needs it, for one attention call.

    ``split`` is the call's ``head_split``: ``SeqToHead`` (or ``PipelinedAttention``) sets
    it from the q/k head counts and ``HeadToSeq`` reads it (one ``_Axis`` per call).
    ``fragment_bytes``: the largest fragment of one message to one peer
    (``comm.post_all_to_all``; the mesh's ``fragment_bytes_for("ulysses")``), used when the
    split is even, so that every rank cuts its messages alike; None: messages go whole.
    """

    def __init__(self, size, group, to_group_rank, stats: CommStats,
                 fragment_bytes: int | None = None):
        self.size, self.group, self.to_group_rank, self.stats = size, group, to_group_rank, stats
        self.fragment_bytes = fragment_bytes
        self.split: HeadSplit | None = None

    @property
    def _fragments(self) -> int | None:
        """``fragment_bytes`` when every rank's blocks are alike (an even split), else None."""
        return self.fragment_bytes if self.split is not None and self.split.even else None

    @property
    def rank(self) -> int:
        """This rank's ulysses coordinate."""
        g = dist.get_rank(self.group)
        return g if self.to_group_rank is None else self.to_group_rank.index(g)

    def exchange(self, send: list, recv: list[list[tuple[int, ...]]]) -> list[list[torch.Tensor]]:
        """Send block j of every part to coordinate j; return what each coordinate sent.

        send: parts, each indexed by destination: a [u, ...] tensor (equal blocks) or a
        list of u tensors. recv[p][i]: the shape of part p's block from coordinate i.
        Returns, per part, the u received blocks (views into the receive buffer).
        """
        return self.start(send, recv).wait()

    def start(self, send: list, recv: list[list[tuple[int, ...]]]) -> _Exchange:
        """``exchange`` posted without waiting: ``wait()`` on the result returns its blocks."""
        u = self.size
        if all(isinstance(p, torch.Tensor) for p in send) and all(
                len(set(shapes)) == 1 for shapes in recv):
            sizes = [p[0].numel() for p in send]
            buf = send[0].new_empty(u, sum(sizes))  # [u, q-block | k-block | v-block]
            off = 0
            for p, n in zip(send, sizes):
                buf[:, off : off + n].view(p.shape).copy_(p)
                off += n
            # [u(src), ...] back: per source, its [q | k | v] block
            return _Exchange(all_to_all_start(buf, self.group, self.to_group_rank, self.stats,
                                              fragment_bytes=self._fragments), recv, None)
        send_sizes = [sum(p[j].numel() for p in send) for j in range(u)]
        buf = send[0][0].new_empty(sum(send_sizes))  # [q_0 k_0 v_0 | q_1 k_1 v_1 | ...]
        off = 0
        for j in range(u):
            for p in send:
                buf[off : off + p[j].numel()].view(p[j].shape).copy_(p[j])
                off += p[j].numel()
        recv_sizes = [sum(prod(shapes[i]) for shapes in recv) for i in range(u)]
        return _Exchange(all_to_all_v_start(buf, send_sizes, recv_sizes, self.group,
                                            self.to_group_rank, self.stats,
                                            fragment_bytes=self._fragments), recv, recv_sizes)


class _Exchange:
    """An ``_Axis.start`` in flight; ``wait()`` returns, per part, the u received blocks."""

    def __init__(self, flight: InFlight, recv, recv_sizes: list[int] | None):
        self._flight, self._recv, self._sizes = flight, recv, recv_sizes

    def wait(self) -> list[list[torch.Tensor]]:
        got = self._flight.wait()
        sources = got.unbind(0) if self._sizes is None else got.split(self._sizes)
        out = [[] for _ in self._recv]
        for i, block in enumerate(sources):
            off = 0
            for p, shapes in enumerate(self._recv):
                n = prod(shapes[i])
                out[p].append(block[off : off + n].view(shapes[i]))
                off += n
        return out


def _by_heads(x: torch.Tensor, counts: tuple[int, ...]):
    """[B, L/P, H, d] -> head blocks of ``counts`` heads, block j destined for rank j:
    a [u, B, L/P, h, d] view when the counts are equal, else a list of u views."""
    b, n, _, d = x.shape
    if len(set(counts)) == 1:
        return x.reshape(b, n, len(counts), counts[0], d).permute(2, 0, 1, 3, 4)
    return list(x.split(counts, dim=2))


def _by_seq_chunk(y: torch.Tensor, u: int) -> torch.Tensor:
    """[B, L/r, h, d] -> [u, B, L/P, h, d]: sequence chunk j is destined for rank j (a view)."""
    b, s, h, d = y.shape
    return y.view(b, u, s // u, h, d).transpose(0, 1)


def _shapes(x: torch.Tensor, tokens: int, heads) -> list[tuple[int, ...]]:
    """Block shapes [B, tokens, h, d] for each head count in ``heads``."""
    return [(x.shape[0], tokens, h, x.shape[3]) for h in heads]


class SeqToHead(torch.autograd.Function):
    """(q [B, L/P, Hq, d], k, v [B, L/P, Hkv, d]) -> (q [B, L/r, q_j, d], k, v [B, L/r, kv_j, d])
    for ulysses rank j (``head_split``'s counts)."""

    @staticmethod
    def forward(ctx, q, k, v, axis: _Axis):
        u, me, n = axis.size, axis.rank, q.shape[1]
        split = head_split(q.shape[2], k.shape[2], u)
        index = kv_send_index(split, q.device)
        if index is not None:  # [B, L/P, Hkv, d] -> [B, L/P, sum kv_j, d]: the heads each rank needs
            k, v = k.index_select(2, index), v.index_select(2, index)
        qc, kc = split.q_counts, split.kv_counts
        recv = [_shapes(q, n, [qc[me]] * u), _shapes(k, n, [kc[me]] * u)]
        axis.split = split
        parts = axis.exchange([_by_heads(q, qc), _by_heads(k, kc), _by_heads(v, kc)],
                              recv + recv[1:])
        ctx.axis, ctx.split, ctx.kv_index = axis, split, index
        # per source i: [B, L/P, heads, d] -> [B, L/r, heads, d] (source i holds chunk i)
        return tuple(torch.cat(p, dim=1) for p in parts)

    @staticmethod
    def backward(ctx, dq, dk, dv):
        axis, split = ctx.axis, ctx.split
        u, n = axis.size, dq.shape[1] // axis.size
        recv = [_shapes(dq, n, split.q_counts), _shapes(dk, n, split.kv_counts)]
        gq, gk, gv = axis.exchange([_by_seq_chunk(g.contiguous(), u) for g in (dq, dk, dv)],
                                   recv + recv[1:])  # per source j: its heads, my tokens
        dq_full, dk_full, dv_full = (torch.cat(g, dim=2) for g in (gq, gk, gv))
        if ctx.kv_index is not None:  # sum the grads of a KV head's replicas back into it
            b, _, _, d = dk_full.shape
            hkv = split.num_kv_heads
            dk_full = dk_full.new_zeros(b, n, hkv, d).index_add_(2, ctx.kv_index, dk_full)
            dv_full = dv_full.new_zeros(b, n, hkv, d).index_add_(2, ctx.kv_index, dv_full)
        return dq_full, dk_full, dv_full, None  # [B, L/P, Hq | Hkv, d]


class HeadToSeq(torch.autograd.Function):
    """out [B, L/r, q_j, d] -> [B, L/P, Hq, d], after ``SeqToHead`` on the same ``axis``."""

    @staticmethod
    def forward(ctx, out, axis: _Axis):
        u, split = axis.size, axis.split
        ctx.axis, ctx.split = axis, split
        n = out.shape[1] // u
        (y,) = axis.exchange([_by_seq_chunk(out.contiguous(), u)],
                             [_shapes(out, n, split.q_counts)])
        return torch.cat(y, dim=2)  # per source j: [B, L/P, q_j, d] -> [B, L/P, Hq, d]

    @staticmethod
    def backward(ctx, grad):
        axis, split = ctx.axis, ctx.split
        me, n = axis.rank, grad.shape[1]
        (g,) = axis.exchange([_by_heads(grad, split.q_counts)],
                             [_shapes(grad, n, [split.q_counts[me]] * axis.size)])
        return torch.cat(g, dim=1), None  # [B, L/r, q_j, d]
