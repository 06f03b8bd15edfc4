"""Ring attention over the ring group, on any local kernel that returns (out, lse).

Each ring rank holds one segment of the sequence (its q, k, v: [B, S, H, d], S = L/r).
Key/value blocks travel around the ring: at step s rank i holds the block of ring rank
``src = (i - s) mod r``, computes its queries against it while the next block is already
in flight, and merges the partial result into the running (out, lse) in fp32.

Which calls a block needs (none, one whole or causal call, masked tiles) is
``usp.masks.block_pieces``'s answer, asked per step by ``RingPlan`` on the segments' global
positions (``segment_spans``, from the layout); the ring never decides visibility itself.
The plan also says how far K/V travel (``ring_hops``): r - 1 hops, or fewer when a sliding
window leaves the farther blocks empty for every rank.

Backward mirrors it: the same K/V hops, plus one fp32 dK/dV accumulator per block that
starts at the rank after the block's owner, collects the share of every rank the block
reached, and after ``hops`` steps jumps home to the owner (the next rank when
hops = r - 1). The owner keeps its own (diagonal) share locally and computes part of it
only after its last send, so that last hop travels while the owner still has work.
A backward kernel call too large for ``usp.dims.work.CALL_BYTES`` (the kernel's fp32 dq
accumulator and GQA-expanded dK/dV grow with the segment) runs as calls over groups of
heads (``head_calls``), accumulated into the same fp32 buffers.

Kernel calls per step (pieces, before head groups) are counted in
``CommStats.kernel_calls``, and the (query, key) pairs they compute in
``CommStats.kernel_pairs``, when a stats object is given: a benchmark can see the blocks a
mask skips and the work each rank does.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from .comm import CommStats, RingComm
from .dims import work
from .dims.tokens import position_tensor, segment_ranges
from .kernels import Kernel
from .masks import Piece, Span, block_pieces, bounds, piece_pairs, tile_size


@lru_cache(maxsize=256)
def segment_positions(seq_len: int, ring: int, balance: str, ring_rank: int) -> torch.Tensor:
    """Global positions of ring rank ``ring_rank``'s segment, in segment order: [L/r] (CPU,
    shared: do not modify; ``usp.dims.tokens.segment_ranges``)."""
    return position_tensor(segment_ranges(seq_len, ring, balance, ring_rank))


@lru_cache(maxsize=256)
def segment_spans(seq_len: int, ring: int, balance: str, ring_rank: int) -> tuple[Span, ...]:
    """The segment's positions as spans of consecutive positions, in segment order."""
    return _spans(segment_ranges(seq_len, ring, balance, ring_rank))


def _split_at(spans, offset: int) -> list[Span]:
    """Spans cut at block offset ``offset``."""
    out = []
    for off, start, n in spans:
        if off < offset < off + n:
            out += [(off, start, offset - off), (offset, start + offset - off, off + n - offset)]
        else:
            out.append((off, start, n))
    return out


def _spans(ranges: tuple[range, ...]) -> tuple[Span, ...]:
    spans, offset = [], 0
    for r in ranges:
        spans.append((offset, r.start, len(r)))
        offset += len(r)
    return tuple(spans)


def last_step(spans: tuple[tuple[Span, ...], ...], lo: int | None, hi: int | None) -> int:
    """The last ring step at which some ring rank (segments ``spans``, one per rank) has
    something to compute under ``bounds`` (lo, hi), on positions alone; 0: none."""
    ring = len(spans)
    for step in range(ring - 1, 0, -1):
        for rank in range(ring):
            if block_pieces(spans[rank], spans[(rank - step) % ring], lo, hi,
                            merge_diagonal=False):
                return step
    return 0


@lru_cache(maxsize=1024)
def ring_hops(seq_len: int, ring: int, balance: str, causal: bool, window: int | None) -> int:
    """How many hops K/V travel round the ring: the last step at which some ring rank has
    something to compute (``block_pieces`` on positions alone; documents never shorten it,
    so every rank knows it without looking at data). ``ring - 1`` without a window."""
    spans = tuple(segment_spans(seq_len, ring, balance, i) for i in range(ring))
    return last_step(spans, *bounds(causal, window))


class RingPlan:
    """The kernel calls of one ring rank for one attention call.

    rank/size: ring coordinate and degree; seg_len: tokens per ring segment (L/r);
    ``window``, ``segment_ids`` (the whole [B, L] on every rank: ``masks.gather_segment_ids``)
    as in ``usp_attention``; ``tile``: tile edge for masked run pairs (default
    ``tile_size``); ``segments``: each ring rank's segment of this row as ranges of global
    positions (``usp.dims.balance.per_document_segments``), instead of ``balance``'s (one
    row's ownership: every batch row must have it; with ``segment_ids`` the trailing steps
    that are empty for every ring rank are dropped, ``dropped_hops`` of them). ``hops``:
    K/V hops the ring makes;
    ``step(s)``: the calls for the block of ring rank ``rank - s``; ``diagonal()`` / ``diagonal_split()``: the own
    block, whole (forward) or as (now, later) around the key half (backward).
    """

    def __init__(self, rank: int, size: int, seg_len: int, causal: bool, balance: str,
                 window: int | None = None, segment_ids: torch.Tensor | None = None,
                 tile: int | None = None, segments: tuple | None = None):
        seq_len = seg_len * size
        balance = "contiguous" if size == 1 else balance  # one segment: the sequence in order
        self.causal, self.window = causal, window
        if window is not None and window >= seq_len:
            window = None  # sees everything the causal order allows
        self.rank, self.size, self.seq_len, self.balance = rank, size, seq_len, balance
        self.lo, self.hi = bounds(causal, window)
        masked = window is not None or segment_ids is not None
        self.tile = (tile or tile_size(window, segment_ids is not None)) if masked else None
        self.segments = None if segments is None or size == 1 else tuple(segments)
        self._row_spans = None if self.segments is None else tuple(map(_spans, self.segments))
        if size == 1:
            self.hops = 0
        elif self.segments is None:
            self.hops = ring_hops(seq_len, size, balance, causal, window)
        else:
            self.hops = last_step(self._row_spans, self.lo, self.hi)
        self.ids = None if segment_ids is None else segment_ids.cpu()  # planned on the host
        self._steps: dict = {}
        self._split = None  # diagonal_split(), kept: a reused plan splits once
        self.dropped_hops = 0  # trailing steps a row's documents leave empty for every rank
        if self.segments is not None and self.ids is not None:
            while self.hops and not any(self._block(i, self.hops) for i in range(size)):
                self.hops, self.dropped_hops = self.hops - 1, self.dropped_hops + 1

    def spans(self, ring_rank: int) -> tuple[Span, ...]:
        if self._row_spans is not None:
            return self._row_spans[ring_rank]
        return segment_spans(self.seq_len, self.size, self.balance, ring_rank)

    def positions(self, ring_rank: int) -> torch.Tensor:
        """Global positions of ring rank ``ring_rank``'s segment, in segment order: [L/r]."""
        if self.segments is not None:
            return position_tensor(self.segments[ring_rank])
        return segment_positions(self.seq_len, self.size, self.balance, ring_rank)

    def _ids(self, ring_rank: int):
        if self.ids is None:
            return None  # [B, L] -> [B, L/r]: the segment's ids in segment order
        return self.ids.index_select(1, self.positions(ring_rank))

    def _block(self, ring_rank: int, s: int) -> list[Piece]:
        """Calls of ring rank ``ring_rank`` at step ``s`` (its own are kept)."""
        if ring_rank == self.rank and s in self._steps:
            return self._steps[s]
        src = (ring_rank - s) % self.size
        pieces = block_pieces(self.spans(ring_rank), self.spans(src), self.lo, self.hi,
                              self._ids(ring_rank), self._ids(src), self.tile)
        if ring_rank == self.rank:
            self._steps[s] = pieces
        return pieces

    def step(self, s: int) -> list[Piece]:
        """Calls for the block that arrives at step ``s`` (from ring rank ``rank - s``)."""
        return self._block(self.rank, s)

    def diagonal(self) -> list[Piece]:
        return self.step(0)

    def diagonal_split(self) -> tuple[list[Piece], list[Piece]]:
        """The own block as (now, later): ``later`` holds the calls whose keys lie in the
        first half and that need no causal flag (the unmasked lower-left quarter under
        causal order, the first key half otherwise); backward runs them last."""
        if self._split is None:
            h = self.seq_len // self.size // 2
            if h == 0:
                self._split = (self.diagonal(), [])
            else:
                spans = _split_at(self.spans(self.rank), h)
                pieces = block_pieces(spans, spans, self.lo, self.hi,
                                      *(2 * [self._ids(self.rank)]), self.tile,
                                      merge_diagonal=False, k_barrier=h)
                later = [p for p in pieces if p.ks.stop <= h and not p.causal]
                self._split = ([p for p in pieces if p.ks.stop > h or p.causal], later)
        return list(self._split[0]), list(self._split[1])


def merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor):
    """Fold one block's result into the running result, in place, by log-sum-exp.

    out [B, S, H, d] fp32, lse [B, H, S] fp32 (views may be slices); block_* likewise in
    any dtype. A row whose block LSE is -inf (no visible key) is left as it was. The one
    place where partial attention results are combined.
    """
    if out.dtype != torch.float32 or lse.dtype != torch.float32:
        raise ValueError(f"merge accumulates in float32, got out {out.dtype}, lse {lse.dtype}")
    block_lse = block_lse.float()
    new_lse = torch.logaddexp(lse, block_lse)  # [B, H, S]; -inf only if both are
    base = new_lse.masked_fill(new_lse == float("-inf"), 0.0)  # rows nobody has seen yet
    w_old = torch.exp(lse - base).transpose(1, 2).unsqueeze(-1)  # [B, S, H, 1]
    w_new = torch.exp(block_lse - base).transpose(1, 2).unsqueeze(-1)
    out.mul_(w_old).add_(block_out.float() * w_new)
    lse.copy_(new_lse)


def add_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> None:
    """Fold attention sinks into a merged result, in place: one more logit ``sinks[h]``
    per query row of head h that carries no value, ``softmax([scores, sink])`` with the
    sink column dropped. out [B, S, H, d] and lse [B, H, S] fp32, as ``merge`` takes them,
    hold every block already; sinks [H]. It is ``merge`` of a block whose out is 0 and
    whose LSE is the sink: out * sigmoid(lse - sink), lse = logaddexp(lse, sink)."""
    sink = sinks.float()[None, :, None].expand(lse.shape)  # [H] -> [B, H, S]
    merge(out, lse, out.new_zeros(()), sink)


def sinks_grad(dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
               sinks: torch.Tensor) -> torch.Tensor:
    """d loss / d sinks [H] (sinks' dtype) of the rows of one rank: dout, out [B, S, H, d]
    and lse [B, H, S] after ``add_sinks``. The sink's probability is exp(sink - lse), and
    softmax's backward gives it -p * rowsum(dout * out) (the sink carries no value)."""
    p = torch.exp(sinks.float()[None, :, None] - lse)  # [B, H, S]
    delta = (dout.float() * out.float()).sum(-1).transpose(1, 2)  # [B, S, H] -> [B, H, S]
    return -(p * delta).sum((0, 2)).to(sinks.dtype)


def _forward(kernel: Kernel, q, k, v, p: Piece, scale):
    if p.mask is None:  # a mask-free call keeps the plain Kernel signature
        return kernel.forward(q[:, p.qs], k[:, p.ks], v[:, p.ks], p.causal, scale)
    return kernel.forward(q[:, p.qs], k[:, p.ks], v[:, p.ks], p.causal, scale, mask=p.mask)


def _backward(kernel: Kernel, dout, q, k, v, out, lse, p: Piece, scale,
              qh: slice = slice(None), kh: slice = slice(None)):
    """The kernel's (dq, dk, dv) of piece ``p`` (rows ``p.qs`` against keys ``p.ks``), for
    query heads ``qh`` and their KV heads ``kh`` (default: all)."""
    args = (dout[:, p.qs, qh], q[:, p.qs, qh], k[:, p.ks, kh], v[:, p.ks, kh],
            out[:, p.qs, qh], lse[:, qh, p.qs], p.causal, scale)
    if p.mask is None:  # a mask-free call keeps the plain Kernel signature
        return kernel.backward(*args)
    return kernel.backward(*args, mask=p.mask)


def head_calls(q, k, p: Piece) -> list[tuple[slice, slice]]:
    """(query heads, KV heads) of each backward kernel call for piece ``p``: one call while
    its transient memory fits ``usp.dims.work.CALL_BYTES``, else head groups
    (``backward_head_groups``; results equal to one call's)."""
    sq, sk = len(range(*p.qs.indices(q.shape[1]))), len(range(*p.ks.indices(k.shape[1])))
    groups = work.backward_head_groups(sq, sk, q.shape[2], k.shape[2], q.shape[3],
                                       q.element_size())
    return [(slice(a.start, a.stop), slice(b.start, b.stop)) for a, b in groups]


def _whole_grads(kernel: Kernel, dout, q, k, v, out, lse, p: Piece, scale, calls):
    """dq, dk, dv (input dtypes) of one piece covering every row and key, over head groups
    ``calls``: each group's dq is whole; a KV head whose query heads are split across calls
    sums their dK/dV in fp32 before the cast (one KV head's at a time)."""
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    g = q.shape[2] // k.shape[2]
    acc = None  # fp32 [2, B, S, 1, d]: the split KV head's dK/dV so far
    for qh, kh in calls:
        gq, gk, gv = _backward(kernel, dout, q, k, v, out, lse, p, scale, qh, kh)
        dq[:, :, qh] = gq
        if qh.stop - qh.start == g * (kh.stop - kh.start):  # every query head of its KV heads
            dk[:, :, kh], dv[:, :, kh] = gk, gv
            continue
        if qh.start == kh.start * g:  # the first part of this KV head
            acc = torch.zeros((2, *gk.shape), dtype=torch.float32, device=q.device)
        acc[0] += gk
        acc[1] += gv
        if qh.stop == kh.stop * g:  # its last part: cast once
            dk[:, :, kh], dv[:, :, kh] = acc[0], acc[1]
    return dq, dk, dv


def _count(stats: CommStats | None, phase: str, step: int, pieces) -> None:
    if stats is not None:
        stats.kernel_calls[(phase, step)] += len(pieces)
        stats.kernel_pairs[(phase, step)] += sum(piece_pairs(p) for p in pieces)


def ring_forward(q, k, v, comm: RingComm | None, plan: RingPlan, kernel: Kernel, scale: float,
                 stats: CommStats | None = None, sinks: torch.Tensor | None = None):
    """q [B, S, Hq, d], k/v [B, S, Hkv, d] -> out [B, S, Hq, d] (q.dtype), lse [B, Hq, S] fp32.

    ``plan``: this ring rank's calls (its rank, the ring size, causal order, balance and
    masks); ``comm``: the ring transport (None when the plan makes no hop). ``sinks`` [Hq]:
    attention sinks, folded in once after every block is merged (``add_sinks``); the out
    and lse returned include them, so ``ring_backward`` on them gives exact dq, dk, dv.
    """
    s = q.shape[1]
    diag = plan.diagonal()
    _count(stats, "forward", 0, diag)
    if stats is not None:
        stats.hops_dropped["forward"] += plan.dropped_hops
    pending = None
    if plan.hops:
        kv = torch.stack([k, v])  # [2, B, S, Hkv, d]: one message per step
        pending = comm.start(kv, tag=0)  # the next block travels while we compute ours
    if len(diag) == 1 and diag[0].qs == slice(0, s):  # the whole diagonal in one call
        out, lse = _forward(kernel, q, k, v, diag[0], scale)
        out, lse = out.float(), lse.float()  # fp32 accumulators
    else:
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full((q.shape[0], q.shape[2], s), float("-inf"), device=q.device)
        for p in diag:
            merge(out[:, p.qs], lse[:, :, p.qs], *_forward(kernel, q, k, v, p, scale))
    for step in range(1, plan.hops + 1):
        kv = pending.wait()
        pending = comm.start(kv, tag=0) if step < plan.hops else None  # overlaps the compute
        pieces = plan.step(step)
        _count(stats, "forward", step, pieces)
        for p in pieces:
            merge(out[:, p.qs], lse[:, :, p.qs], *_forward(kernel, q, kv[0], kv[1], p, scale))
    if sinks is not None:  # once, on the merge of every block
        add_sinks(out, lse, sinks)
    return out.to(q.dtype), lse


def ring_backward(dout, q, k, v, out, lse, comm: RingComm | None, plan: RingPlan,
                  kernel: Kernel, scale: float, stats: CommStats | None = None):
    """Exact grads of ``ring_forward``: returns dq, dk, dv in the input dtypes.

    Step 0 runs the "now" part of the diagonal block while the first K/V block travels;
    step s (1..hops) runs the block of ring rank ``src = i - s``, adds the accumulator for
    that block received from the previous rank and sends it on; after step ``hops`` it
    goes to the block's owner, which meanwhile runs the "later" part of its diagonal.
    """
    hops, size, whole = plan.hops, plan.size, slice(0, q.shape[1])
    if stats is not None:
        stats.hops_dropped["backward"] += plan.dropped_hops
    if not hops and len(diag := plan.diagonal()) == 1 and diag[0].qs == diag[0].ks == whole:
        # one kernel call holds every gradient (pure ulysses, or a window within the
        # segment): no accumulators, no K/V stack; the same values as the general path
        _count(stats, "backward", 0, diag)
        calls = head_calls(q, k, diag[0])
        if len(calls) > 1:
            return _whole_grads(kernel, dout, q, k, v, out, lse, diag[0], scale, calls)
        grads = _backward(kernel, dout, q, k, v, out, lse, diag[0], scale)
        return tuple(g.to(x.dtype) for g, x in zip(grads, (q, k, v)))
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    own = torch.stack([k, v])  # [2, B, S, Hkv, d]
    dkv_own = torch.zeros(own.shape, dtype=torch.float32, device=q.device)

    def accumulate(pieces, kv, dkv):
        for p in pieces:
            for qh, kh in head_calls(q, kv[0], p):  # one call unless it is too large
                grads = _backward(kernel, dout, q, kv[0], kv[1], out, lse, p, scale, qh, kh)
                dq[:, p.qs, qh] += grads[0]
                dkv[0][:, p.ks, kh] += grads[1]
                dkv[1][:, p.ks, kh] += grads[2]

    now, later = plan.diagonal_split() if hops else (plan.diagonal(), [])
    _count(stats, "backward", 0, now + later)
    kv_pending = comm.start(own, tag=0) if hops else None
    accumulate(now, own, dkv_own)
    acc_pending = None  # the accumulator in flight to the next rank
    for step in range(1, hops + 1):
        kv = kv_pending.wait()
        kv_pending = comm.start(kv, tag=0) if step < hops else None
        acc = torch.zeros(own.shape, dtype=torch.float32, device=q.device)
        pieces = plan.step(step)
        _count(stats, "backward", step, pieces)
        accumulate(pieces, kv, acc)
        if acc_pending is not None:  # the same block's shares of the ranks before us
            acc += acc_pending.wait()
        if step < hops or hops == size - 1:  # on to the next rank (the owner after r-1 hops)
            acc_pending = comm.start(acc, tag=1)
        else:  # home to the owner, ``hops`` ranks back
            acc_pending = comm.start(acc, tag=1, shift=size - hops)
    accumulate(later, own, dkv_own)  # while our own accumulator makes its last hop
    if acc_pending is not None:
        dkv_own += acc_pending.wait()
    return dq.to(q.dtype), dkv_own[0].to(k.dtype), dkv_own[1].to(v.dtype)


class RingAttention(torch.autograd.Function):
    """Autograd wrapper: forward saves (q, k, v, out, lse) and backward runs the dK/dV ring.

    apply(q, k, v, comm, plan, kernel, scale[, stats[, sinks]]), as ``ring_forward``; the
    gradient of ``sinks`` [Hq] is this rank's share (``sinks_grad`` over its rows).
    """

    @staticmethod
    def forward(ctx, q, k, v, comm, plan, kernel, scale, stats=None, sinks=None):
        out, lse = ring_forward(q, k, v, comm, plan, kernel, scale, stats, sinks)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.args = (comm, plan, kernel, scale, stats)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        dq, dk, dv = ring_backward(dout, q, k, v, out, lse, *ctx.args)
        grads = [dq, dk, dv] + [None] * (len(ctx.needs_input_grad) - 3)
        if sinks is not None and ctx.needs_input_grad[8]:
            grads[8] = sinks_grad(dout, out, lse, sinks)
        return tuple(grads)
