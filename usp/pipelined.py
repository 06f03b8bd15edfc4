"""``PipelinedAttention``: ``usp_attention``'s ulysses all-to-alls in pipeline stages.

With ``a2a_chunks = c > 1`` the heads go through the three phases (``SeqToHead``, the ring,
``HeadToSeq``) in ``c`` stages (``usp.dims.stages.head_chunks``): the all-to-all of stage
t+1 travels while the ring computes stage t, and stage t's output travels back while stage
t+1 computes; backward mirrors it.
"""

from __future__ import annotations

import torch

from .dims.heads import head_split
from .dims.stages import HeadChunk, head_chunks
from .ring import ring_backward, ring_forward, sinks_grad
from .ulysses import _Axis, _by_seq_chunk


def _heads(x: torch.Tensor, r: tuple[int, int]) -> torch.Tensor:
    return x[:, :, r[0] : r[1]]  # [B, T, H, d] -> [B, T, heads r, d]


def _width(r: tuple[int, int]) -> int:
    return r[1] - r[0]


def _stage(sinks: torch.Tensor | None, chunk: HeadChunk) -> torch.Tensor | None:
    return None if sinks is None else sinks[chunk.q[0] : chunk.q[1]]  # [Hq] -> stage heads


class PipelinedAttention(torch.autograd.Function):
    """q [B, L/P, Hq, d], k/v [B, L/P, Hkv, d] -> out [B, L/P, Hq, d]: SeqToHead, ring,
    HeadToSeq over the heads of ``usp.dims.stages.head_chunks`` stages, each all-to-all posted
    asynchronously so that it travels while another stage's ring pass computes.

    apply(q, k, v, axis, chunks, ring, sinks) with ``ring`` = ``ring_forward``'s arguments
    after q, k, v and ``sinks`` [Hq] or None (each stage folds in those of its heads). A KV
    head that serves several stages of a rank travels with the first and its gradients with
    the last, so the bytes equal the unpipelined call's; each all-to-all is ``chunks``
    messages. Backward: the output grads of stage t+1 travel while stage t's ring
    backward runs, and stage t's dq/dk/dv travel home while stage t+1 computes.
    """

    @staticmethod
    def forward(ctx, q, k, v, axis: _Axis, chunks: int, ring, sinks=None):
        u, me = axis.size, axis.rank
        b, n, hq, d = q.shape
        split = head_split(q.shape[2], k.shape[2], u)
        axis.split = split
        stages = head_chunks(split, chunks)  # [rank][stage]
        mine: tuple[HeadChunk, ...] = stages[me]

        def post_in(t):  # to rank j: my tokens of its stage-t query heads and new KV heads
            send = [[_heads(x, getattr(stages[j][t], f)) for j in range(u)]
                    for x, f in ((q, "q"), (k, "kv_first"), (v, "kv_first"))]
            q_shape = [(b, n, _width(mine[t].q), d)] * u
            kv_shape = [(b, n, _width(mine[t].kv_first), d)] * u
            return axis.start(send, [q_shape, kv_shape, kv_shape])

        k0 = split.kv_heads[me][0]  # first global KV head of this rank
        have_k, have_v = [], []  # this rank's KV heads so far: [B, L/r, 1, d] each
        saved, back = [], []
        flight = post_in(0)
        for t in range(chunks):
            # per source i: [B, L/P, h, d] -> [B, L/r, h, d] (source i holds chunk i)
            qs, kn, vn = (torch.cat(p, dim=1) for p in flight.wait())
            if t + 1 < chunks:
                flight = post_in(t + 1)  # travels while this stage computes
            have_k += [kn[:, :, i : i + 1] for i in range(kn.shape[2])]
            have_v += [vn[:, :, i : i + 1] for i in range(vn.shape[2])]
            ka, kb = (h - k0 for h in mine[t].kv)
            if kb > ka:  # [B, L/r, 1, d] x heads -> [B, L/r, kv heads of the stage, d]
                kn, vn = torch.cat(have_k[ka:kb], dim=2), torch.cat(have_v[ka:kb], dim=2)
            ks, vs = kn, vn  # an empty stage keeps the empty blocks it received
            if qs.shape[2]:  # [B, L/r, h, d], [B, h, L/r]
                out, lse = ring_forward(qs, ks, vs, *ring, sinks=_stage(sinks, mine[t]))
            else:  # a stage without heads on this ulysses coordinate (and its ring)
                out, lse = qs, qs.new_empty(b, 0, qs.shape[1], dtype=torch.float32)
            saved += [qs, ks, vs, out, lse]
            # [B, L/r, h, d] -> [u, B, L/P, h, d]: sequence chunk i goes back to rank i
            back.append(axis.start([_by_seq_chunk(out.contiguous(), u)],
                                   [[(b, n, _width(stages[j][t].q), d) for j in range(u)]]))
        out = q.new_empty(b, n, hq, d)
        for t, flight in enumerate(back):
            for j, block in enumerate(flight.wait()[0]):  # [B, L/P, h_j, d] from rank j
                _heads(out, stages[j][t].q).copy_(block)
        ctx.save_for_backward(*saved, sinks)
        ctx.stages, ctx.me, ctx.axis, ctx.ring, ctx.k0 = stages, me, axis, ring, k0
        ctx.kv_shape, ctx.kv_dtype = k.shape, k.dtype
        return out

    @staticmethod
    def backward(ctx, grad):
        stages, axis, ring, k0 = ctx.stages, ctx.axis, ctx.ring, ctx.k0
        u, chunks, mine = axis.size, len(ctx.stages[0]), ctx.stages[ctx.me]
        b, n, hq, d = grad.shape
        *saved, sinks = ctx.saved_tensors
        dsinks = None if sinks is None else torch.zeros_like(sinks)

        def post_grad(t):  # to rank j: the output grads of my tokens for its stage-t heads
            return axis.start([[_heads(grad, stages[j][t].q) for j in range(u)]],
                              [[(b, n, _width(mine[t].q), d)] * u])

        seg = n * u  # tokens per ring segment
        nkv = sum(_width(c.kv_first) for c in mine)  # this rank's KV heads
        dkv = grad.new_zeros(2, b, seg, nkv, d, dtype=torch.float32)  # over all stages
        back = []
        flight = post_grad(0)
        for t in range(chunks):
            dout = torch.cat(flight.wait()[0], dim=1)  # [B, L/P, h, d] x u -> [B, L/r, h, d]
            if t + 1 < chunks:
                flight = post_grad(t + 1)  # travels while this stage's ring backward runs
            qs, ks, vs, out, lse = saved[5 * t : 5 * t + 5]
            ka, kb = (h - k0 for h in mine[t].kv)
            dq = torch.zeros_like(qs)
            if qs.shape[2]:
                dq, dk, dv = ring_backward(dout.contiguous(), qs, ks, vs, out, lse, *ring)
                if sinks is not None:  # this stage's heads, over this rank's rows
                    a, z = mine[t].q
                    dsinks[a:z] += sinks_grad(dout, out, lse, sinks[a:z])
                dkv[0, :, :, ka:kb] += dk
                dkv[1, :, :, ka:kb] += dv
            la, lb = (h - k0 for h in mine[t].kv_last)
            done = dkv[:, :, :, la:lb].to(ctx.kv_dtype)  # KV heads no later stage touches
            # [B, L/r, h, d] -> [u, B, L/P, h, d]: sequence chunk i goes home to rank i
            send = [_by_seq_chunk(x.contiguous(), u) for x in (dq, done[0], done[1])]
            kv_shape = [(b, n, _width(stages[j][t].kv_last), d) for j in range(u)]
            back.append(axis.start(send, [[(b, n, _width(stages[j][t].q), d)
                                           for j in range(u)], kv_shape, kv_shape]))
        dq = grad.new_empty(b, n, hq, d)
        dk = grad.new_zeros(ctx.kv_shape, dtype=torch.float32)
        dv = torch.zeros_like(dk)
        for t, flight in enumerate(back):
            gq, gk, gv = flight.wait()
            for j in range(u):  # a KV head replicated to several ranks sums their grads
                _heads(dq, stages[j][t].q).copy_(gq[j])
                _heads(dk, stages[j][t].kv_last).add_(gk[j])
                _heads(dv, stages[j][t].kv_last).add_(gv[j])
        return dq, dk.to(ctx.kv_dtype), dv.to(ctx.kv_dtype), None, None, None, dsinks
