"""``usp_attention``: ulysses all-to-all, ring attention, all-to-all back."""

from __future__ import annotations

import torch

from .comm import RingComm
from .kernels import Kernel, get_kernel
from .layout import SequenceLayout
from .masks import check_masks, gather_segment_ids
from .mesh import SPMesh
from .ring import RingAttention, RingPlan
from .ulysses import HeadToSeq, SeqToHead, _Axis
from .validate import RING_IMPLS, check_heads, check_kernel, check_ring_impl

__all__ = ["RING_IMPLS", "check_inputs", "usp_attention"]


def check_inputs(q, k, v, mesh: SPMesh, layout: SequenceLayout) -> None:
    """Shape rules for one call; raises ValueError before any collective."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"usp_attention expects [B, L/P, H, d] tensors, got q{tuple(q.shape)} "
            f"k{tuple(k.shape)} v{tuple(v.shape)}"
        )
    if k.shape != v.shape or q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3]:
        raise ValueError(
            f"q{tuple(q.shape)}, k{tuple(k.shape)}, v{tuple(v.shape)} disagree: k and v must "
            f"match, and share batch, local length and head dim with q"
        )
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if layout.mesh is not mesh:
        raise ValueError("layout was built for a different SPMesh than the one passed")
    if q.shape[1] != layout.local_len:
        raise ValueError(
            f"local sequence length {q.shape[1]} != seq_len/(ring*ulysses) = "
            f"{layout.seq_len}/{mesh.sp_size} = {layout.local_len}; shard inputs with "
            f"layout.shard(x, dim=1)"
        )
    check_heads(q.shape[2], k.shape[2], mesh.ulysses)


def usp_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mesh: SPMesh,
    layout: SequenceLayout,
    causal: bool = True,
    kernel: str | Kernel = "torch",
    scale: float | None = None,
    ring_impl: str = "usp",
    segment_ids: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Exact attention over the whole sequence held across the SP group.

    q [B, L/P, Hq, d], k/v [B, L/P, Hkv, d] (this rank's tokens, as ``layout.shard`` gives
    them) -> out [B, L/P, Hq, d]. Differentiable. ``kernel`` is the local block kernel
    (``torch``, ``flash_attn``, ``reference``); ``ring_impl="ring_flash_attn"`` swaps our
    ring for the ring-flash-attn package's CUDA ring (optional extra). Raises ValueError
    before any collective when the shapes, the kernel or the ring engine cannot work.

    Masks (``usp.masks``), on top of ``causal``, for query position i and key position j:

    - ``segment_ids``: LongTensor [B, L/P], this rank's shard (``layout.shard(ids, dim=1)``)
      of the global document ids [B, L]: i sees j only when their ids are equal (packed
      documents; rows of the batch may pack differently). Costs one all-gather of the ids
      over the SP group per call.
    - ``window``: causal: i sees j only when 0 <= i - j < window; not causal: |i - j| <
      window. K/V travel only the ring hops that reach into the window
      (``usp.planner.traffic.windowed_ring_hops``; with zigzag every hop, see there).

    Every query sees at least its own key, so no output row is undefined. Blocks a mask
    leaves empty are skipped. The ``torch`` and ``reference`` kernels take both masks,
    ``flash_attn`` takes ``window`` only; ``ring_impl="ring_flash_attn"`` takes neither.
    """
    check_inputs(q, k, v, mesh, layout)
    check_masks(segment_ids, window, batch=q.shape[0], seq_len=q.shape[1], device=q.device,
                kernel=kernel, ring_impl=ring_impl)
    dev, dtype, d = q.device.type, q.dtype, q.shape[-1]
    if isinstance(kernel, str):
        check_kernel(kernel, dev, dtype, d, ring_impl, causal, layout.balance)
    else:  # a Kernel object answers for itself; the ring engine is still checked
        check_ring_impl(ring_impl, dev, dtype, d, causal, layout.balance)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if mesh.sp_size > 1:  # once per signature: every SP rank must make the same call
        kname = kernel if isinstance(kernel, str) else type(kernel).__name__
        mesh.agree_once("usp_attention(q, k shapes, dtype, seq_len, balance, causal, kernel, "
                        "ring_impl, scale, window, segment_ids given)",
                        (tuple(q.shape), tuple(k.shape), str(q.dtype), layout.seq_len,
                         layout.balance, causal, kname, ring_impl, scale, window,
                         segment_ids is not None))
    kern = get_kernel(kernel)
    ids = None if segment_ids is None else gather_segment_ids(segment_ids, layout)  # [B, L]
    u = mesh.ulysses
    axis = None
    if u > 1:
        axis = _Axis(u, mesh.group("ulysses"), mesh.to_group_rank("ulysses"), mesh.comm)
        # [B, L/P, H, d] -> [B, L/r, H/u, d]: all tokens of the ring segment, some heads
        q, k, v = SeqToHead.apply(q, k, v, axis)
    if ring_impl == "ring_flash_attn":
        from .ring_flash import ring_flash_attn

        out = ring_flash_attn(q, k, v, mesh, layout.balance, causal, scale)
    else:
        comm = None
        if mesh.ring > 1:
            # the ring's own group: P2P on the world group would queue behind (and on
            # NCCL, serialise with) FSDP's collectives
            comm = RingComm(mesh.axis_ranks("ring"), mesh.ring_rank, mesh.group("ring"),
                            mesh.comm)
        plan = RingPlan(mesh.ring_rank, mesh.ring, layout.segment_len, causal, layout.balance,
                        window, ids)
        out = RingAttention.apply(
            q, k, v, comm, mesh.ring_rank, mesh.ring, causal, layout.balance, kern, scale, plan,
            mesh.comm,
        )  # [B, L/r, H/u, d]
    if axis is not None:
        out = HeadToSeq.apply(out, axis)  # [B, L/r, H/u, d] -> [B, L/P, H, d]
    return out
