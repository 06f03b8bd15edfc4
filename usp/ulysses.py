"""The ulysses all-to-all: "some tokens, all heads" <-> "all tokens of the segment, some heads".

Forward of attention uses ``SeqToHead`` (q, k, v in ONE fused all-to-all) and
``HeadToSeq`` (the output back). Each is the other's backward.

Send buffers are packed per destination as contiguous blocks ([u, q-block | k-block |
v-block]), so every pack and unpack is one dense copy per tensor.

GQA: ulysses rank j computes query heads [j*Hq/u, (j+1)*Hq/u) and receives exactly the KV
heads those use. When u <= Hkv each rank gets Hkv/u distinct KV heads; when u > Hkv each
KV head goes to the u/Hkv ranks whose query heads share it (replicated only that far),
and its gradients are summed back on the way home.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from .comm import CommStats, all_to_all
from .validate import check_heads


def kv_head_index(num_q_heads: int, num_kv_heads: int, ulysses: int) -> torch.Tensor:
    """KV heads sent to each ulysses rank: LongTensor [u, kv_per_rank]."""
    per_rank = check_heads(num_q_heads, num_kv_heads, ulysses)
    if num_kv_heads % ulysses == 0:
        return torch.arange(num_kv_heads).view(ulysses, per_rank)
    return (torch.arange(ulysses) // (ulysses // num_kv_heads)).view(ulysses, 1)


@lru_cache(maxsize=64)
def replicated_kv_index(
    num_q_heads: int, num_kv_heads: int, ulysses: int, device: torch.device
) -> torch.Tensor | None:
    """KV head for each ulysses rank when KV heads are replicated (u > Hkv): LongTensor [u]
    on ``device``; None when the KV heads split evenly and need no gather.

    Built once per shape and device: a fresh index on every call of every layer would be
    a blocking host-to-device copy on CUDA.
    """
    if num_kv_heads % ulysses == 0:
        return None
    return kv_head_index(num_q_heads, num_kv_heads, ulysses).reshape(-1).to(device)


class _Axis:
    """The ulysses group as the all-to-all needs it."""

    def __init__(self, size, group, to_group_rank, stats: CommStats):
        self.size, self.group, self.to_group_rank, self.stats = size, group, to_group_rank, stats

    def exchange(self, parts: list[torch.Tensor]) -> list[torch.Tensor]:
        """Send block j of every part to rank j; returns the parts received, same shapes.

        parts: tensors [u, ...] (any strides) indexed by destination; returned tensors are
        [u, ...] views into the receive buffer, indexed by source.
        """
        u = self.size
        sizes = [p[0].numel() for p in parts]
        send = parts[0].new_empty(u, sum(sizes))  # [u, q-block | k-block | v-block]
        off = 0
        for p, n in zip(parts, sizes):
            send[:, off : off + n].view(p.shape).copy_(p)
            off += n
        recv = all_to_all(send, self.group, self.to_group_rank, self.stats)  # [u(src), ...]
        out, off = [], 0
        for p, n in zip(parts, sizes):
            out.append(recv[:, off : off + n].view(p.shape))
            off += n
        return out


def _by_dest(x: torch.Tensor, u: int) -> torch.Tensor:
    """[B, L/P, u*h, d] -> [u, B, L/P, h, d]: head group j is destined for rank j (a view)."""
    b, n, hh, d = x.shape
    return x.reshape(b, n, u, hh // u, d).permute(2, 0, 1, 3, 4)


def _by_seq_chunk(y: torch.Tensor, u: int) -> torch.Tensor:
    """[B, L/r, h, d] -> [u, B, L/P, h, d]: sequence chunk j is destined for rank j (a view)."""
    b, s, h, d = y.shape
    return y.view(b, u, s // u, h, d).transpose(0, 1)


def _join_seq(x: torch.Tensor) -> torch.Tensor:
    """[u(src), B, L/P, h, d] -> [B, L/r, h, d] (contiguous copy)."""
    u, b, n, h, d = x.shape
    return x.transpose(0, 1).reshape(b, u * n, h, d)


def _join_heads(x: torch.Tensor) -> torch.Tensor:
    """[u(src), B, L/P, h, d] -> [B, L/P, u*h, d] (contiguous copy)."""
    u, b, n, h, d = x.shape
    return x.permute(1, 2, 0, 3, 4).reshape(b, n, u * h, d)


class SeqToHead(torch.autograd.Function):
    """(q [B, L/P, Hq, d], k, v [B, L/P, Hkv, d]) -> (q [B, L/r, Hq/u, d], k, v [B, L/r, n, d])."""

    @staticmethod
    def forward(ctx, q, k, v, axis: _Axis):
        u, hkv = axis.size, k.shape[2]
        index = replicated_kv_index(q.shape[2], hkv, u, q.device)
        if index is not None:  # [B, L/P, Hkv, d] -> [B, L/P, u*n, d]: the heads each rank needs
            k, v = k.index_select(2, index), v.index_select(2, index)
        parts = axis.exchange([_by_dest(q, u), _by_dest(k, u), _by_dest(v, u)])
        ctx.axis, ctx.kv_index, ctx.hkv = axis, index, hkv
        return tuple(_join_seq(p) for p in parts)  # each [B, L/r, heads, d]

    @staticmethod
    def backward(ctx, dq, dk, dv):
        u = ctx.axis.size
        gq, gk, gv = ctx.axis.exchange(
            [_by_seq_chunk(g.contiguous(), u) for g in (dq, dk, dv)]
        )  # each [u(head group), B, L/P, h, d]
        dq_full, dk_full, dv_full = _join_heads(gq), _join_heads(gk), _join_heads(gv)
        if ctx.kv_index is not None:  # sum the grads of a KV head's replicas back into it
            b, n, _, d = dk_full.shape
            dk_sum = dk_full.new_zeros(b, n, ctx.hkv, d).index_add_(2, ctx.kv_index, dk_full)
            dv_sum = dv_full.new_zeros(b, n, ctx.hkv, d).index_add_(2, ctx.kv_index, dv_full)
            dk_full, dv_full = dk_sum, dv_sum
        return dq_full, dk_full, dv_full, None


class HeadToSeq(torch.autograd.Function):
    """out [B, L/r, Hq/u, d] -> [B, L/P, Hq, d]."""

    @staticmethod
    def forward(ctx, out, axis: _Axis):
        ctx.axis = axis
        (y,) = axis.exchange([_by_seq_chunk(out.contiguous(), axis.size)])
        return _join_heads(y)  # [u(head group), B, L/P, h, d] -> [B, L/P, Hq, d]

    @staticmethod
    def backward(ctx, grad):
        (g,) = ctx.axis.exchange([_by_dest(grad, ctx.axis.size)])
        return _join_seq(g), None  # [B, L/r, Hq/u, d]
