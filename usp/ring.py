"""Ring attention over the ring group, on any local kernel that returns (out, lse).

Each ring rank holds one segment of the sequence (its q, k, v: [B, S, H, d], S = L/r).
Key/value blocks travel around the ring: at step s rank i holds the block of ring rank
``src = (i - s) mod r``, computes its queries against it while the next block is already
in flight, and merges the partial result into the running (out, lse) in fp32.

Backward mirrors it: the same KV ring, plus one fp32 dK/dV accumulator per block that
starts at the rank after the block's owner, collects every other rank's share on its way
round and arrives home after r-1 hops. The owner keeps its own (diagonal) share locally
and computes half of it only after its last send, so that last hop home travels while
the owner still has work.

Causal masking by layout (i = this ring rank, src = owner of the KV block):

- contiguous: src == i diagonal (causal), src < i full, src > i skipped;
- zigzag (segment = chunk i ++ chunk 2r-1-i, halves of S/2): src == i diagonal;
  src < i: all queries see the first half of the block (chunk src) fully;
  src > i: the second half of the queries (chunk 2r-1-i) sees the whole block fully.
"""

from __future__ import annotations

import torch

from .comm import RingComm
from .kernels import Kernel

_ALL = slice(None)


def merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor):
    """Fold one block's result into the running result, in place, by log-sum-exp.

    out [B, S, H, d] fp32, lse [B, H, S] fp32 (views may be slices); block_* likewise in
    any dtype. The one place where partial attention results are combined.
    """
    block_lse = block_lse.float()
    new_lse = torch.logaddexp(lse, block_lse)  # [B, H, S]
    w_old = torch.exp(lse - new_lse).transpose(1, 2).unsqueeze(-1)  # [B, S, H, 1]
    w_new = torch.exp(block_lse - new_lse).transpose(1, 2).unsqueeze(-1)
    out.mul_(w_old).add_(block_out.float() * w_new)
    lse.copy_(new_lse)


def block_plan(src: int, rank: int, seg_len: int, causal: bool, balance: str):
    """(query slice, key slice, causal flag) for the block from ``src``, or None to skip."""
    if not causal:
        return _ALL, _ALL, False
    if src == rank:
        return _ALL, _ALL, True
    if balance == "contiguous":
        return (_ALL, _ALL, False) if src < rank else None
    half = seg_len // 2
    if src < rank:
        return _ALL, slice(0, half), False
    return slice(half, None), _ALL, False


def ring_forward(q, k, v, comm: RingComm | None, rank: int, size: int, causal: bool,
                 balance: str, kernel: Kernel, scale: float):
    """q [B, S, Hq, d], k/v [B, S, Hkv, d] -> out [B, S, Hq, d] (q.dtype), lse [B, Hq, S] fp32."""
    if size == 1:  # no ring: the local kernel is the whole answer
        return kernel.forward(q, k, v, causal, scale)
    s = q.shape[1]
    kv = torch.stack([k, v])  # [2, B, S, Hkv, d]: one message per step
    pending = comm.start(kv, tag=0)  # the next block travels while we compute ours
    # step 0 is always the diagonal block (src == rank): it initialises out and lse
    out, lse = kernel.forward(q, k, v, causal, scale)
    out = out.float()  # fp32 accumulator
    kv = pending.wait()
    for step in range(1, size):
        pending = comm.start(kv, tag=0) if step + 1 < size else None  # overlaps the compute
        plan = block_plan((rank - step) % size, rank, s, causal, balance)
        if plan is not None:
            qs, ks, cf = plan
            blk_out, blk_lse = kernel.forward(q[:, qs], kv[0][:, ks], kv[1][:, ks], cf, scale)
            merge(out[:, qs], lse[:, :, qs], blk_out, blk_lse)
        if pending is not None:
            kv = pending.wait()
    return out.to(q.dtype), lse


def diagonal_split(seg_len: int, causal: bool):
    """The diagonal block as (now, later) lists of (query slice, key slice, causal flag).

    Causal: the segment's positions increase, so with h = S/2 it is [:h]x[:h] and
    [h:]x[h:] (causal, square) plus [h:]x[:h] (unmasked), which backward runs last.
    Not causal: the two key halves. Every piece's backward is exact on its own given the
    full (out, lse): dQ sums over pieces and dK/dV rows belong to one piece each.
    """
    h = seg_len // 2
    if h == 0:
        return [(_ALL, _ALL, causal)], []
    lo, hi = slice(0, h), slice(h, None)
    if causal:
        return [(lo, lo, True), (hi, hi, True)], [(hi, lo, False)]
    return [(_ALL, lo, False)], [(_ALL, hi, False)]


def ring_backward(dout, q, k, v, out, lse, comm: RingComm | None, rank: int, size: int,
                  causal: bool, balance: str, kernel: Kernel, scale: float):
    """Exact grads of ``ring_forward``: returns dq, dk, dv in the input dtypes.

    Step 0 runs half of the diagonal block while the first K/V block travels; step s
    (1..r-1) runs the block of ring rank ``src = i - s``, adds the accumulator for that
    block received from the previous rank and sends it on; after r-1 hops the accumulator
    reaches the block's owner, which meanwhile runs the other half of its diagonal.
    """
    if size == 1:
        return kernel.backward(dout, q, k, v, out, lse, causal, scale)
    s = q.shape[1]
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    own = torch.stack([k, v])  # [2, B, S, Hkv, d]
    dkv_own = torch.zeros(own.shape, dtype=torch.float32, device=q.device)

    def run(pieces, kv, dkv):
        for qs, ks, cf in pieces:
            dq_b, dk_b, dv_b = kernel.backward(
                dout[:, qs], q[:, qs], kv[0][:, ks], kv[1][:, ks], out[:, qs],
                lse[:, :, qs], cf, scale,
            )
            dq[:, qs] += dq_b
            dkv[0][:, ks] += dk_b
            dkv[1][:, ks] += dv_b

    now, later = diagonal_split(s, causal)
    kv_pending = comm.start(own, tag=0)
    run(now, own, dkv_own)
    kv = kv_pending.wait()
    acc_pending = None  # the accumulator in flight to the next rank
    for step in range(1, size):
        kv_pending = comm.start(kv, tag=0) if step + 1 < size else None
        acc = torch.zeros(own.shape, dtype=torch.float32, device=q.device)
        plan = block_plan((rank - step) % size, rank, s, causal, balance)
        if plan is not None:
            run([plan], kv, acc)
        if acc_pending is not None:  # the same block's shares of the ranks before us
            acc += acc_pending.wait()
        acc_pending = comm.start(acc, tag=1)  # after the last step: to the block's owner
        if kv_pending is not None:
            kv = kv_pending.wait()
    run(later, own, dkv_own)  # while our own accumulator makes its last hop
    dkv_own += acc_pending.wait()
    return dq.to(q.dtype), dkv_own[0].to(k.dtype), dkv_own[1].to(v.dtype)


class RingAttention(torch.autograd.Function):
    """Autograd wrapper: forward saves (q, k, v, out, lse) and backward runs the dK/dV ring."""

    @staticmethod
    def forward(ctx, q, k, v, comm, rank, size, causal, balance, kernel, scale):
        out, lse = ring_forward(q, k, v, comm, rank, size, causal, balance, kernel, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (comm, rank, size, causal, balance, kernel, scale)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ring_backward(dout, q, k, v, out, lse, *ctx.args)
        return dq, dk, dv, None, None, None, None, None, None, None
