"""The ulysses all-to-all: "some tokens, all heads" <-> "all tokens of the segment, some heads".

Forward of attention uses ``SeqToHead`` (q, k, v in ONE fused all-to-all) and
``HeadToSeq`` (the output back). Each is the other's backward.

GQA: ulysses rank j computes query heads [j*Hq/u, (j+1)*Hq/u) and receives exactly the KV
heads those use. When u <= Hkv each rank gets Hkv/u distinct KV heads; when u > Hkv each
KV head goes to the u/Hkv ranks whose query heads share it (replicated only that far),
and its gradients are summed back on the way home.
"""

from __future__ import annotations

import torch

from .comm import CommStats, all_to_all
from .validate import check_heads


def kv_head_index(num_q_heads: int, num_kv_heads: int, ulysses: int) -> torch.Tensor:
    """KV heads sent to each ulysses rank: LongTensor [u, kv_per_rank]."""
    per_rank = check_heads(num_q_heads, num_kv_heads, ulysses)
    if num_kv_heads % ulysses == 0:
        return torch.arange(num_kv_heads).view(ulysses, per_rank)
    return (torch.arange(ulysses) // (ulysses // num_kv_heads)).view(ulysses, 1)


class _Axis:
    """The ulysses group as the all-to-all needs it."""

    def __init__(self, size, group, to_group_rank, stats: CommStats):
        self.size, self.group, self.to_group_rank, self.stats = size, group, to_group_rank, stats

    def seq_to_head(self, send: torch.Tensor) -> torch.Tensor:
        """[u, B, L/P, h, d] (head group j for rank j) -> [B, L/r, h, d] (this rank's heads)."""
        u, b, n, h, d = send.shape
        recv = all_to_all(send, self.group, self.to_group_rank, self.stats)  # [u(src), B, L/P, h, d]
        return recv.transpose(0, 1).reshape(b, u * n, h, d)  # [B, L/r, h, d]

    def head_to_seq(self, y: torch.Tensor) -> torch.Tensor:
        """[B, L/r, h, d] -> [B, L/P, u, h, d] (head group j came from rank j)."""
        b, s, h, d = y.shape
        u = self.size
        send = y.view(b, u, s // u, h, d).transpose(0, 1)  # [u, B, L/P, h, d]
        recv = all_to_all(send, self.group, self.to_group_rank, self.stats)  # [u(src), B, L/P, h, d]
        return recv.permute(1, 2, 0, 3, 4)  # [B, L/P, u, h, d]


class SeqToHead(torch.autograd.Function):
    """(q [B, L/P, Hq, d], k, v [B, L/P, Hkv, d]) -> (q [B, L/r, Hq/u, d], k, v [B, L/r, n, d])."""

    @staticmethod
    def forward(ctx, q, k, v, axis: _Axis, kv_index: torch.Tensor):
        b, n, hq, d = q.shape
        u, nkv = kv_index.shape
        hl = hq // u
        flat = kv_index.reshape(-1).to(q.device)
        replicated = flat.numel() != k.shape[2]

        def by_dest(x, heads):  # [B, L/P, u*heads, d] -> [u, B, L/P, heads, d] (a view)
            return x.reshape(b, n, u, heads, d).permute(2, 0, 1, 3, 4)

        # one send buffer [u, B, L/P, Hq/u + 2n, d]: per destination its q heads, then K, V
        send = q.new_empty(u, b, n, hl + 2 * nkv, d)
        send[..., :hl, :] = by_dest(q, hl)
        send[..., hl : hl + nkv, :] = by_dest(k.index_select(2, flat) if replicated else k, nkv)
        send[..., hl + nkv :, :] = by_dest(v.index_select(2, flat) if replicated else v, nkv)
        y = axis.seq_to_head(send)  # [B, L/r, Hq/u + 2n, d]
        ctx.axis, ctx.kv_index, ctx.hkv = axis, flat, k.shape[2]
        return y[:, :, :hl], y[:, :, hl : hl + nkv], y[:, :, hl + nkv :]

    @staticmethod
    def backward(ctx, dq, dk, dv):
        hl, nkv = dq.shape[2], dk.shape[2]
        g = ctx.axis.head_to_seq(torch.cat([dq, dk, dv], dim=2))  # [B, L/P, u, hl + 2n, d]
        b, n, u, _, d = g.shape
        dq_full = g[:, :, :, :hl].reshape(b, n, u * hl, d)  # [B, L/P, Hq, d]
        dk_full = g.new_zeros(b, n, ctx.hkv, d)
        dv_full = g.new_zeros(b, n, ctx.hkv, d)
        # sum replicated KV heads' grads back into their source head
        dk_full.index_add_(2, ctx.kv_index, g[:, :, :, hl : hl + nkv].reshape(b, n, u * nkv, d))
        dv_full.index_add_(2, ctx.kv_index, g[:, :, :, hl + nkv :].reshape(b, n, u * nkv, d))
        return dq_full, dk_full, dv_full, None, None


class HeadToSeq(torch.autograd.Function):
    """out [B, L/r, Hq/u, d] -> [B, L/P, Hq, d]."""

    @staticmethod
    def forward(ctx, out, axis: _Axis):
        ctx.axis = axis
        y = axis.head_to_seq(out)  # [B, L/P, u, Hq/u, d]
        b, n, u, h, d = y.shape
        return y.reshape(b, n, u * h, d)

    @staticmethod
    def backward(ctx, grad):
        b, n, hq, d = grad.shape
        u = ctx.axis.size
        send = grad.reshape(b, n, u, hq // u, d).permute(2, 0, 1, 3, 4)  # [u, B, L/P, Hq/u, d]
        return ctx.axis.seq_to_head(send), None
