"""Optional adapter: the ring-flash-attn package as the ring engine (CUDA only).

ring-flash-attn 0.1.8 imports flash_attn and transformers at import time (and breaks with
transformers 5.x), so it is imported only when ``ring_impl="ring_flash_attn"`` is asked
for. Its zigzag layout (ring rank i holds chunks i and 2r-1-i) is the same as ours; its
zigzag functions assert ``causal=True`` (``usp.rules.check_ring_impl`` refuses the rest
before any collective).

Traffic, as 0.1.8's ``ring_flash_attn.py`` and ``zigzag_ring_flash_attn.py`` send it (the
same for both): forward sends this rank's K and V to the next rank r-1 times, in the input
dtype; backward sends K and V r-1 times again, plus the dK and dV accumulators at every
one of the r steps, in fp32 (the last hop brings each block's gradient home). That volume
is recorded in ``mesh.comm`` under "ring", like our own ring; its time is not (the
package waits internally).
"""

from __future__ import annotations

import torch


def _import():
    try:
        import ring_flash_attn as rfa
    except ImportError as e:  # pragma: no cover - depends on the machine
        raise ImportError(
            "ring_impl='ring_flash_attn' needs the ring-flash-attn package with flash-attn "
            "and transformers<5 (CUDA only): pip install 'usp[gpu]' 'transformers<5'; "
            "or use ring_impl='usp'"
        ) from e
    return rfa


def ring_traffic(k: torch.Tensor, ring: int) -> tuple[int, int]:
    """Bytes this rank sends to other ranks in ring-flash-attn's (forward, backward).

    ``k``: this rank's K block [B, L/r, Hkv', d] (V has the same shape and dtype).
    """
    if ring == 1:
        return 0, 0  # its only send is then dK/dV to itself
    kv = 2 * k.numel() * k.element_size()  # one hop of K and V, input dtype
    dkv = 2 * k.numel() * 4  # one hop of the dK and dV accumulators, fp32
    return (ring - 1) * kv, (ring - 1) * kv + ring * dkv


class _CountTraffic(torch.autograd.Function):
    """Identity on (k, v) that records the package's ring bytes: the forward's when it runs,
    the backward's when the gradients come back through (after the package's backward)."""

    @staticmethod
    def forward(ctx, k, v, stats, ring):
        fwd, ctx.bwd_bytes = ring_traffic(k, ring)
        ctx.stats = stats
        stats.record("ring", fwd)
        return k.view_as(k), v.view_as(v)

    @staticmethod
    def backward(ctx, dk, dv):
        ctx.stats.record("ring", ctx.bwd_bytes)
        return dk, dv, None, None


def ring_flash_attn(q, k, v, mesh, balance: str, causal: bool, scale: float):
    """q [B, L/r, Hq/u, d], k/v [B, L/r, Hkv', d] on this ring rank -> out, same layout as q."""
    if mesh.to_group_rank("ring") is not None:
        raise ValueError(
            "ring-flash-attn orders its ring by process-group rank, but this mesh's ring "
            f"coordinates follow the host layout ({mesh.axis_ranks('ring')}); use ring_impl='usp'"
        )
    rfa = _import()
    fn = rfa.zigzag_ring_flash_attn_func if balance == "zigzag" else rfa.ring_flash_attn_func
    if mesh.ring > 1:
        k, v = _CountTraffic.apply(k, v, mesh.comm, mesh.ring)
    return fn(q, k, v, dropout_p=0.0, softmax_scale=scale, causal=causal, group=mesh.group("ring"))
