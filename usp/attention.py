"""``usp_attention``: ulysses all-to-all, ring attention, all-to-all back.

With ``a2a_chunks = c > 1`` the heads go through the three phases in ``c`` pipeline stages
(``PipelinedAttention``): the all-to-all of stage t+1 travels while the ring computes
stage t, and stage t's output travels back while stage t+1 computes; backward mirrors it
(``usp/pipelined.py``).
"""

from __future__ import annotations

import torch

from .comm import RingComm
from .dims.heads import check_heads
from .dims.stages import check_a2a_chunks, default_a2a_chunks
from .kernels import Kernel, get_kernel
from .layout import SequenceLayout
from .masks import check_masks, gather_segment_ids
from .mesh import SPMesh
from .pipelined import PipelinedAttention
from .ring import RingAttention, RingPlan
from .ring_flash import ring_flash_attn
from .ulysses import HeadToSeq, SeqToHead, _Axis
from .rules import RING_IMPLS, check_kernel, check_ring_impl

__all__ = ["RING_IMPLS", "PipelinedAttention", "attention_stages", "check_inputs",
           "local_attention", "usp_attention"]


def local_attention(q, k, v, causal: bool = True, kernel: str | Kernel = "torch", scale=None,
                    segment_ids: torch.Tensor | None = None, window: int | None = None,
                    sinks: torch.Tensor | None = None):
    """Single-process attention with autograd: q [B, L, Hq, d], k/v [B, L, Hkv, d] -> [B, L, Hq, d].

    ``segment_ids`` [B, L] long, ``window`` and ``sinks`` [Hq] as in ``usp_attention`` (the
    same plan, on one ring rank: no hop, no transport).
    """
    check_masks(segment_ids, window, batch=q.shape[0], seq_len=q.shape[1], device=q.device,
                kernel=kernel)
    check_sinks(sinks, q)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    plan = RingPlan(0, 1, q.shape[1], causal, "contiguous", window, segment_ids)
    return RingAttention.apply(q, k, v, None, plan, get_kernel(kernel), scale, None, sinks)


def check_sinks(sinks: torch.Tensor | None, q: torch.Tensor, ring_impl: str = "usp") -> None:
    """``sinks`` must be None or a floating [Hq] tensor (global query-head order) on q's
    device, and the ring engine must take them; raises ValueError before any collective."""
    if sinks is None:
        return
    hq = q.shape[2] if q.dim() == 4 else None
    if not isinstance(sinks, torch.Tensor) or not sinks.is_floating_point() or (
            tuple(sinks.shape) != (hq,)):
        got = tuple(sinks.shape) if isinstance(sinks, torch.Tensor) else type(sinks).__name__
        raise ValueError(f"sinks must be a floating tensor [Hq] = [{hq}] (one logit per query "
                         f"head, every rank the same), got {got}")
    if sinks.device != q.device:
        raise ValueError(f"sinks are on {sinks.device} but q is on {q.device}; move them")
    if ring_impl != "usp":
        raise ValueError(f"ring_impl={ring_impl!r} cannot apply sinks (its ring returns no "
                         f"LSE to fold them into); use ring_impl='usp'")


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


def attention_stages(mesh: SPMesh, num_q_heads: int, num_kv_heads: int,
                     a2a_chunks: int | None = None, ring_impl: str = "usp") -> int:
    """The pipeline stages a ``usp_attention`` call on ``mesh`` runs: the mesh's setting
    (``mesh.a2a_chunks``, ``usp.dims.stages.default_a2a_chunks`` for these heads) unless the
    call overrides it with ``a2a_chunks``; 1 with ``ring_impl="ring_flash_attn"``. Raises
    ValueError when the heads cannot take them."""
    if a2a_chunks is None:
        if ring_impl == "ring_flash_attn":
            return 1
        return default_a2a_chunks(mesh.a2a_chunks, mesh.ulysses_crosses_hosts, num_q_heads,
                                  num_kv_heads, mesh.ulysses)
    return check_a2a_chunks(a2a_chunks, num_q_heads, num_kv_heads, mesh.ulysses)


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
    a2a_chunks: int | None = None,
    sinks: torch.Tensor | None = None,
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

    Pipeline stages of the ulysses all-to-alls (``PipelinedAttention``): the mesh carries
    them (``SPMesh.build(a2a_chunks=...)``; ``"auto"`` unless given: 1 inside a host,
    pipelined when a ulysses group crosses hosts, ``usp.dims.stages.default_a2a_chunks``;
    usp-train puts the planner's count there). ``a2a_chunks`` overrides them for this call:
    1 to at most the query heads of a ulysses rank (``usp.dims.stages.check_a2a_chunks``).
    Same bytes and results, that many times as many messages; no effect without a ulysses
    group; 1 with ``ring_impl="ring_flash_attn"``. The mesh also says whether the messages
    travel in fragments (``SPMesh.fragment_bytes_for``).

    ``sinks`` [Hq] (gpt-oss's; global head order, the same on every rank): head h's softmax
    runs over the visible keys and one more logit ``sinks[h]`` that carries no value, folded
    in once after the LSE merge of every block (``ring.add_sinks``); no byte more travels.
    Each rank's ``sinks.grad`` is its share (its heads over its rows): the sum over the SP
    group is the gradient. Not with ``ring_impl="ring_flash_attn"``.

    Every query sees at least its own key, so no output row is undefined. Blocks a mask
    leaves empty are skipped. The ``torch`` and ``reference`` kernels take both masks,
    ``flash_attn`` takes ``window`` only; ``ring_impl="ring_flash_attn"`` takes neither.
    """
    stages = _check_call(q, k, v, mesh, layout, causal, kernel, ring_impl, segment_ids,
                         window, a2a_chunks, sinks)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    _agree(mesh, layout, q, k, kernel, causal, ring_impl, scale, window,
           segment_ids is not None, stages, sinks is not None)
    kern = get_kernel(kernel)
    ids = None if segment_ids is None else gather_segment_ids(segment_ids, layout)  # [B, L]
    axis, comm = _exchanges(mesh, ring_impl)
    if layout.balance == "per_document":  # each row its own segments: a ring pass per row
        return _per_row(q, k, v, axis, comm, layout, causal, window, ids, kern, scale, stages,
                        sinks)
    plan = RingPlan(mesh.ring_rank, mesh.ring, layout.segment_len, causal, layout.balance,
                    window, ids)
    ring = (comm, plan, kern, scale, mesh.comm)  # ring_forward's arguments after q, k, v
    if axis is not None and stages > 1:
        return PipelinedAttention.apply(q, k, v, axis, stages, ring, sinks)  # [B, L/P, Hq, d]
    if axis is not None:
        # [B, L/P, H, d] -> [B, L/r, H/u, d]: all tokens of the ring segment, some heads
        q, k, v = SeqToHead.apply(q, k, v, axis)
        sinks = _my_sinks(sinks, axis)
    if ring_impl == "ring_flash_attn":
        out = ring_flash_attn(q, k, v, mesh, layout.balance, causal, scale)
    else:
        out = RingAttention.apply(q, k, v, *ring, sinks)  # [B, L/r, H/u, d]
    if axis is not None:
        out = HeadToSeq.apply(out, axis)  # [B, L/r, H/u, d] -> [B, L/P, H, d]
    return out


def _my_sinks(sinks: torch.Tensor | None, axis: _Axis) -> torch.Tensor | None:
    """[Hq] -> [q_j]: the sinks of the query heads this ulysses rank computes (after
    ``SeqToHead`` set the call's split); autograd puts its gradient back at those heads."""
    if sinks is None:
        return None
    a, b = axis.split.q_ranges[axis.rank]
    return sinks[a:b]


def _agree(mesh: SPMesh, layout: SequenceLayout, q, k, kernel, *rest) -> None:
    """Once per signature (a collective the first time): every SP rank makes the same call."""
    if mesh.sp_size > 1:
        kname = kernel if isinstance(kernel, str) else type(kernel).__name__
        mesh.agree_once("usp_attention(q, k shapes, dtype, seq_len, balance, kernel, causal, "
                        "ring_impl, scale, window, segment_ids given, a2a_chunks, sinks given)",
                        (tuple(q.shape), tuple(k.shape), str(q.dtype), layout.seq_len,
                         layout.balance, kname) + rest)


def _per_row(q, k, v, axis, comm, layout, causal, window, ids, kern, scale, stages, sinks):
    """``usp_attention`` under a ``DocumentLayout``: one ring pass for the whole batch when
    every row has the same documents, else one per row (B passes of 1/B of the bytes)."""
    mesh = layout.mesh
    if stages > 1:
        raise ValueError(f"a per_document layout runs the ring row by row; its ulysses "
                         f"all-to-alls are not pipelined: pass a2a_chunks=1 (got {stages})")
    if axis is not None:
        q, k, v = SeqToHead.apply(q, k, v, axis)  # [B, L/P, H, d] -> [B, L/r, H/u, d]
        sinks = _my_sinks(sinks, axis)
    same = all(docs == layout.rows[0] for docs in layout.rows)
    rows = [slice(0, q.shape[0])] if same else [slice(b, b + 1) for b in range(q.shape[0])]
    outs = []
    for b in rows:
        plan = row_plan(layout, b, causal, window, None if ids is None else ids[b])
        outs.append(RingAttention.apply(q[b], k[b], v[b], comm, plan, kern, scale, mesh.comm,
                                        sinks))
    out = torch.cat(outs) if len(outs) > 1 else outs[0]  # [B, L/r, H/u, d]
    return out if axis is None else HeadToSeq.apply(out, axis)  # -> [B, L/P, H, d]


def row_plan(layout, rows: slice, causal: bool, window: int | None,
             ids: torch.Tensor | None) -> RingPlan:
    """This rank's ``RingPlan`` for the batch rows ``rows`` of a ``DocumentLayout`` (which
    share their documents), under ``causal``, ``window`` and the rows' global document ids
    ``ids`` [rows, L] (or None). Built once and kept in ``layout.plans``: a later call with
    the same rows, causal order and window reuses it when its ids are equal (the plan is a
    pure function of these and the layout), else builds it again and keeps the new one."""
    key = (rows.start, rows.stop, causal, window)
    kept = layout.plans.get(key)
    if kept is not None and (kept[0] is None if ids is None else
                             kept[0] is not None and torch.equal(kept[0], ids)):
        return kept[1]
    mesh = layout.mesh
    plan = RingPlan(mesh.ring_rank, mesh.ring, layout.segment_len, causal, "zigzag", window,
                    ids, segments=layout.segments[rows.start])
    layout.plans[key] = (None if ids is None else ids.clone(), plan)
    return plan


def _check_call(q, k, v, mesh: SPMesh, layout: SequenceLayout, causal: bool, kernel,
                ring_impl: str, segment_ids, window, a2a_chunks, sinks) -> int:
    """Every rule for one ``usp_attention`` call, before any collective; returns its
    pipeline stages (``attention_stages``)."""
    check_inputs(q, k, v, mesh, layout)
    check_sinks(sinks, q, ring_impl)
    if layout.balance == "per_document" and (ring_impl != "usp" or q.shape[0] != layout.batch):
        raise ValueError(f"a per_document layout of {layout.batch} rows needs ring_impl='usp' "
                         f"and q of {layout.batch} rows, got {ring_impl!r} and "
                         f"{q.shape[0]}; build DocumentLayout from this batch's documents")
    check_masks(segment_ids, window, batch=q.shape[0], seq_len=q.shape[1], device=q.device,
                kernel=kernel, ring_impl=ring_impl)
    dev, dtype, d = q.device.type, q.dtype, q.shape[-1]
    if isinstance(kernel, str):
        check_kernel(kernel, dev, dtype, d, ring_impl, causal, layout.balance)
    else:  # a Kernel object answers for itself; the ring engine is still checked
        check_ring_impl(ring_impl, dev, dtype, d, causal, layout.balance)
    stages = attention_stages(mesh, q.shape[2], k.shape[2], a2a_chunks, ring_impl)
    if stages > 1 and ring_impl == "ring_flash_attn":
        raise ValueError(f"a2a_chunks={stages} pipelines the usp ring only; use "
                         f"ring_impl='usp' or a2a_chunks=1 with ring_flash_attn")
    return stages


def _exchanges(mesh: SPMesh, ring_impl: str) -> tuple[_Axis | None, RingComm | None]:
    """The call's ulysses exchange (None without a ulysses group) and ring transport (None
    without a ring, or when ring-flash-attn brings its own)."""
    axis = comm = None
    if mesh.ulysses > 1:
        axis = _Axis(mesh.ulysses, mesh.group("ulysses"), mesh.to_group_rank("ulysses"),
                     mesh.comm, mesh.fragment_bytes_for("ulysses"))
    if mesh.ring > 1 and ring_impl == "usp":
        # the ring's own group: P2P on the world group would queue behind (and on
        # NCCL, serialise with) FSDP's collectives
        comm = RingComm(mesh.axis_ranks("ring"), mesh.ring_rank, mesh.group("ring"), mesh.comm,
                        fragment_bytes=mesh.fragment_bytes_for("ring"))
    return axis, comm
