"""``usp_attention``: ulysses all-to-all, ring attention, all-to-all back.

With ``a2a_chunks = c > 1`` the heads go through the three phases in ``c`` pipeline stages
(``PipelinedAttention``): the all-to-all of stage t+1 travels while the ring computes
stage t, and stage t's output travels back while stage t+1 computes; backward mirrors it.
"""

from __future__ import annotations

import torch

from .comm import RingComm
from .dims.heads import check_heads, head_split
from .dims.stages import HeadChunk, check_a2a_chunks, default_a2a_chunks, head_chunks
from .kernels import Kernel, get_kernel
from .layout import SequenceLayout
from .masks import check_masks, gather_segment_ids
from .mesh import SPMesh
from .ring import RingAttention, RingPlan, ring_backward, ring_forward
from .ulysses import HeadToSeq, SeqToHead, _Axis, _by_seq_chunk
from .rules import RING_IMPLS, check_kernel, check_ring_impl

__all__ = ["RING_IMPLS", "PipelinedAttention", "attention_stages", "check_inputs",
           "local_attention", "usp_attention"]


def local_attention(q, k, v, causal: bool = True, kernel: str | Kernel = "torch", scale=None,
                    segment_ids: torch.Tensor | None = None, window: int | None = None):
    """Single-process attention with autograd: q [B, L, Hq, d], k/v [B, L, Hkv, d] -> [B, L, Hq, d].

    ``segment_ids`` [B, L] long and ``window`` as in ``usp_attention`` (the same plan, on
    one ring rank: no hop, no transport).
    """
    check_masks(segment_ids, window, batch=q.shape[0], seq_len=q.shape[1], device=q.device,
                kernel=kernel)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    plan = RingPlan(0, 1, q.shape[1], causal, "contiguous", window, segment_ids)
    return RingAttention.apply(q, k, v, None, plan, get_kernel(kernel), scale)


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

    Every query sees at least its own key, so no output row is undefined. Blocks a mask
    leaves empty are skipped. The ``torch`` and ``reference`` kernels take both masks,
    ``flash_attn`` takes ``window`` only; ``ring_impl="ring_flash_attn"`` takes neither.
    """
    stages = _check_call(q, k, v, mesh, layout, causal, kernel, ring_impl, segment_ids,
                         window, a2a_chunks)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if mesh.sp_size > 1:  # once per signature: every SP rank must make the same call
        kname = kernel if isinstance(kernel, str) else type(kernel).__name__
        mesh.agree_once("usp_attention(q, k shapes, dtype, seq_len, balance, causal, kernel, "
                        "ring_impl, scale, window, segment_ids given, a2a_chunks)",
                        (tuple(q.shape), tuple(k.shape), str(q.dtype), layout.seq_len,
                         layout.balance, causal, kname, ring_impl, scale, window,
                         segment_ids is not None, stages))
    kern = get_kernel(kernel)
    ids = None if segment_ids is None else gather_segment_ids(segment_ids, layout)  # [B, L]
    axis, comm = _exchanges(mesh, ring_impl)
    if layout.balance == "per_document":  # each row its own segments: a ring pass per row
        return _per_row(q, k, v, axis, comm, layout, causal, window, ids, kern, scale, stages)
    plan = RingPlan(mesh.ring_rank, mesh.ring, layout.segment_len, causal, layout.balance,
                    window, ids)
    ring = (comm, plan, kern, scale, mesh.comm)  # ring_forward's arguments after q, k, v
    if axis is not None and stages > 1:
        return PipelinedAttention.apply(q, k, v, axis, stages, ring)  # [B, L/P, Hq, d]
    if axis is not None:
        # [B, L/P, H, d] -> [B, L/r, H/u, d]: all tokens of the ring segment, some heads
        q, k, v = SeqToHead.apply(q, k, v, axis)
    if ring_impl == "ring_flash_attn":
        from .ring_flash import ring_flash_attn

        out = ring_flash_attn(q, k, v, mesh, layout.balance, causal, scale)
    else:
        out = RingAttention.apply(q, k, v, *ring)  # [B, L/r, H/u, d]
    if axis is not None:
        out = HeadToSeq.apply(out, axis)  # [B, L/r, H/u, d] -> [B, L/P, H, d]
    return out


def _per_row(q, k, v, axis, comm, layout, causal, window, ids, kern, scale, stages):
    """``usp_attention`` under a ``DocumentLayout``: one ring pass for the whole batch when
    every row has the same documents, else one per row (B passes of 1/B of the bytes)."""
    mesh = layout.mesh
    if stages > 1:
        raise ValueError(f"a per_document layout runs the ring row by row; its ulysses "
                         f"all-to-alls are not pipelined: pass a2a_chunks=1 (got {stages})")
    if axis is not None:
        q, k, v = SeqToHead.apply(q, k, v, axis)  # [B, L/P, H, d] -> [B, L/r, H/u, d]
    same = all(docs == layout.rows[0] for docs in layout.rows)
    rows = [slice(0, q.shape[0])] if same else [slice(b, b + 1) for b in range(q.shape[0])]
    outs = []
    for b in rows:
        plan = row_plan(layout, b, causal, window, None if ids is None else ids[b])
        outs.append(RingAttention.apply(q[b], k[b], v[b], comm, plan, kern, scale, mesh.comm))
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
                ring_impl: str, segment_ids, window, a2a_chunks) -> int:
    """Every rule for one ``usp_attention`` call, before any collective; returns its
    pipeline stages (``attention_stages``)."""
    check_inputs(q, k, v, mesh, layout)
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


def _heads(x: torch.Tensor, r: tuple[int, int]) -> torch.Tensor:
    return x[:, :, r[0] : r[1]]  # [B, T, H, d] -> [B, T, heads r, d]


def _width(r: tuple[int, int]) -> int:
    return r[1] - r[0]


class PipelinedAttention(torch.autograd.Function):
    """q [B, L/P, Hq, d], k/v [B, L/P, Hkv, d] -> out [B, L/P, Hq, d]: SeqToHead, ring,
    HeadToSeq over the heads of ``usp.dims.stages.head_chunks`` stages, each all-to-all posted
    asynchronously so that it travels while another stage's ring pass computes.

    apply(q, k, v, axis, chunks, ring) with ``ring`` = ``ring_forward``'s arguments after
    q, k, v. A KV head that serves several stages of a rank travels with the first and its
    gradients with the last, so the bytes equal the unpipelined call's; each all-to-all is
    ``chunks`` messages. Backward: the output grads of stage t+1 travel while stage t's ring
    backward runs, and stage t's dq/dk/dv travel home while stage t+1 computes.
    """

    @staticmethod
    def forward(ctx, q, k, v, axis: _Axis, chunks: int, ring):
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
            if qs.shape[2]:
                out, lse = ring_forward(qs, ks, vs, *ring)  # [B, L/r, h, d], [B, h, L/r]
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
        ctx.save_for_backward(*saved)
        ctx.stages, ctx.me, ctx.axis, ctx.ring, ctx.k0 = stages, me, axis, ring, k0
        ctx.kv_shape, ctx.kv_dtype = k.shape, k.dtype
        return out

    @staticmethod
    def backward(ctx, grad):
        stages, axis, ring, k0 = ctx.stages, ctx.axis, ctx.ring, ctx.k0
        u, chunks, mine = axis.size, len(ctx.stages[0]), ctx.stages[ctx.me]
        b, n, hq, d = grad.shape
        saved = ctx.saved_tensors

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
        return dq, dk.to(ctx.kv_dtype), dv.to(ctx.kv_dtype), None, None, None
