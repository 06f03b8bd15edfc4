"""Which keys each query sees, decided per (query block, key block) in one place.

For a query at global position i and a key at global position j (row b of the batch):

- ``causal``: j <= i;
- ``window`` w (Hugging Face Mistral/Qwen2 rule): causal: 0 <= i - j < w; not causal:
  |i - j| < w. A window of L or more is no window;
- ``segment_ids`` (packed documents): ids[b, i] == ids[b, j].

Every query sees at least its own key, so every output row is defined; a row that sees no
key *inside one block* is a kernel call's "no contribution" (out 0, LSE -inf, which
``usp.ring.merge`` folds in as nothing).

``block_pieces`` is the one function that turns the rule into kernel calls for one
(query block, key block) pair. A block is a list of spans of consecutive global positions
(``usp.ring.segment_spans``: one span per ring segment, two under zigzag). With documents,
each span is first cut at their edges (``_doc_runs``): a run of at least a tile that is one
document in every batch row meets only the runs of its own document, and then the positions
alone decide (no document mask, nothing computed across documents); shorter runs side by
side stay one span. Each span pair is trimmed to the rows and keys that see anything; if
the rule then leaves it whole, causal or empty it is one call or none; otherwise (a window
edge, document boundaries) it is cut in halves at global multiples of ``tile_size``,
recursively, down to tiles computed with a ``BlockMask`` (which kernels turn into an additive mask or a flash-attn window). Whole
pieces side by side merge into one call. The ring asks it for every block
(``usp.ring.RingPlan``) and for how far K/V must travel (``usp.ring.ring_hops``); the
kernels only read the ``BlockMask`` they are given.

Segment ids reach every rank as one all-gather of the [B, L/P] shards over the SP group
(``gather_segment_ids``): integers, 8 bytes a token (a K/V hop carries
2 x heads x head_dim x dtype bytes a token), recorded under the "sp" axis of
``CommStats``. With the whole [B, L] on every rank each one plans every block up front,
and the ring's K/V messages stay one tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .kernels import supported_masks

Span = tuple[int, int, int]  # (offset in the block, first global position, length)
MASK_KINDS = ("window", "segment_ids")
TILE = 256  # tile edge for masked span pairs (tokens)


def bounds(causal: bool, window: int | None) -> tuple[int | None, int | None]:
    """(lo, hi): a query at i sees a key at j iff lo <= i - j <= hi (None: unbounded)."""
    if window is None:
        return (0, None) if causal else (None, None)
    return (0, window - 1) if causal else (1 - window, window - 1)


def tile_size(window: int | None, segments: bool) -> int | None:
    """Tile edge for span pairs the mask cuts: ~window/4 (32..256), 256 for documents alone,
    None when nothing but causal order is asked (span pairs are never cut then)."""
    if window is None:
        return TILE if segments else None
    return max(32, min(TILE, 1 << max(0, (window // 4).bit_length() - 1)))


@dataclass(eq=False)
class BlockMask:
    """Visibility inside one kernel call: query rows at global positions q0..q0+m-1, keys
    at k0..k0+n-1, visible iff lo <= qpos - kpos <= hi and (``seg``) same document."""

    q0: int
    k0: int
    m: int
    n: int
    lo: int | None
    hi: int | None
    seg: torch.Tensor | None = None  # bool [B, m, n]: query and key in the same document

    def positional(self, device=None) -> torch.Tensor:
        """bool [m, n]: what the positions alone allow."""
        d = (torch.arange(self.m, device=device)[:, None] + (self.q0 - self.k0)
             - torch.arange(self.n, device=device)[None, :])  # qpos - kpos
        ok = torch.ones(self.m, self.n, dtype=torch.bool, device=device)
        if self.lo is not None:
            ok &= d >= self.lo
        if self.hi is not None:
            ok &= d <= self.hi
        return ok

    def visible(self, device=None) -> torch.Tensor:
        """bool [B or 1, m, n]: True where the query sees the key."""
        pos = self.positional(device)[None]
        return pos if self.seg is None else pos & self.seg.to(device)

    def additive(self, dtype: torch.dtype, device=None) -> torch.Tensor:
        """[B or 1, 1, m, n] in ``dtype``: 0 where visible, -inf elsewhere."""
        vis = self.visible(device)[:, None]
        return torch.zeros(vis.shape, dtype=dtype, device=device).masked_fill_(~vis, float("-inf"))

    def empty_rows(self, device=None) -> torch.Tensor | None:
        """bool [B or 1, m]: rows that see no key here; None when there are none (tiles are
        trimmed, so a positional-only mask never has one)."""
        if self.seg is None:
            return None
        rows = ~self.visible(device).any(-1)
        return rows if bool(rows.any()) else None

    @property
    def band(self) -> tuple[int, int] | None:
        """flash-attn's ``(window_size_left, window_size_right)`` (bottom-right aligned, -1
        unbounded) for a positional-only mask; None when documents cut it or a side would
        be negative."""
        if self.seg is not None:
            return None
        off = self.q0 - self.k0 - (self.n - self.m)
        left = -1 if self.hi is None else self.hi - off
        right = -1 if self.lo is None else off - self.lo
        if (self.hi is not None and left < 0) or (self.lo is not None and right < 0):
            return None  # flash-attn reads a negative side as unbounded (trimmed: never)
        return left, right


@dataclass(eq=False)
class Piece:
    """One kernel call: query rows ``qs`` of the query block against keys ``ks`` of the key
    block; ``causal``: the kernel's top-left causal flag (square, same positions);
    ``mask``: anything else, or None (every pair visible)."""

    qs: slice
    ks: slice
    causal: bool = False
    mask: BlockMask | None = None

    @property
    def whole(self) -> bool:
        return not self.causal and self.mask is None


def piece_pairs(p: Piece) -> int:
    """(query, key) pairs the kernel computes for piece ``p`` (per batch row and head): the
    lower triangle with the diagonal of a causal call, the whole rectangle otherwise (a
    masked tile is computed dense and masked)."""
    m, n = p.qs.stop - p.qs.start, p.ks.stop - p.ks.start
    return m * (m + 1) // 2 if p.causal else m * n


def _tile(q: Span, k: Span, lo, hi, q_ids, k_ids) -> Piece | None:
    """The call for one (query span, key span) pair, trimmed to what is visible; None: skip.
    ``q_ids``/``k_ids``: the blocks' document ids [B, block len] or None."""
    qo, qa, m = q
    ko, kc, n = k
    r0, r1, c0, c1 = qa, qa + m, kc, kc + n  # global positions kept
    if lo is not None:  # rows see a key only from kc + lo on; keys are seen up to qa+m-1-lo
        r0, c1 = max(r0, kc + lo), min(c1, qa + m - lo)
    if hi is not None:
        r1, c0 = min(r1, kc + n + hi), max(c0, qa - hi)
    if r0 >= r1 or c0 >= c1:
        return None
    m, n = r1 - r0, c1 - c0
    whole = (lo is None or r0 - (c1 - 1) >= lo) and (hi is None or r1 - 1 - c0 <= hi)
    diag = r0 == c0 and m == n and lo == 0 and (hi is None or hi >= m - 1)
    qs, ks = slice(qo + r0 - qa, qo + r1 - qa), slice(ko + c0 - kc, ko + c1 - kc)
    if q_ids is None:
        if whole or diag:
            return Piece(qs, ks, causal=diag and not whole)
        return Piece(qs, ks, mask=BlockMask(r0, c0, m, n, lo, hi))
    same = q_ids[:, qs, None] == k_ids[:, None, ks]  # [B, m, n]
    pos = BlockMask(r0, c0, m, n, lo, hi).positional(same.device)
    vis = same & pos
    rows, cols = vis.any(2).any(0), vis.any(1).any(0)  # [m], [n]: seen by some batch row
    if not bool(rows.any()):
        return None
    i0, i1 = _first_last(rows)
    j0, j1 = _first_last(cols)
    vis, same, pos = (t[..., i0:i1, j0:j1] for t in (vis, same, pos))
    qs, ks = slice(qs.start + i0, qs.start + i1), slice(ks.start + j0, ks.start + j1)
    r0, c0 = r0 + i0, c0 + j0
    if bool(vis.all()):
        return Piece(qs, ks)
    if r0 == c0 and i1 - i0 == j1 - j0 and torch.equal(vis, vis.new_ones(vis.shape[1:]).tril()
                                                          .expand_as(vis)):
        return Piece(qs, ks, causal=True)
    return Piece(qs, ks, mask=BlockMask(r0, c0, i1 - i0, j1 - j0, lo, hi, same))


def _first_last(flags: torch.Tensor) -> tuple[int, int]:
    idx = flags.nonzero()
    return int(idx[0]), int(idx[-1]) + 1


def _halves(span: Span, tile: int) -> list[Span]:
    """``span`` cut in two near its middle, at a global multiple of ``tile`` when one lies
    inside (so query and key blocks of the same positions are cut alike); whole if short."""
    off, start, n = span
    if n <= tile:
        return [span]
    mid = round((start + n / 2) / tile) * tile
    if not start < mid < start + n:
        mid = start + n // 2
    return [(off, start, mid - start), (off + mid - start, mid, start + n - mid)]


def _quad(q: Span, k: Span, lo, hi, q_ids, k_ids, tile: int | None, out: list) -> None:
    """Pieces of one span pair: whole, causal or empty as it stands (documents: when the
    rows and keys share no id, or all carry one id), else (a window edge, document
    boundaries) cut in halves, recursively, down to tiles of ``tile`` that carry a mask."""
    p = _tile(q, k, lo, hi, None, None)  # positions alone, trimmed to what is visible
    if p is None:
        return
    if tile is None or (q_ids is None and p.mask is None):
        out.append(p)
        return
    if q_ids is not None:  # per batch row: the id ranges of the rows and keys kept
        qi, ki = q_ids[:, p.qs], k_ids[:, p.ks]
        qlo, qhi, klo, khi = qi.amin(1), qi.amax(1), ki.amin(1), ki.amax(1)
        if bool(((qhi < klo) | (khi < qlo)).all()):
            return  # no document in common
        if p.mask is None and bool(((qlo == qhi) & (klo == khi) & (qlo == klo)).all()):
            out.append(p)  # one document on both sides: the positions decide alone
            return
    q = (p.qs.start, q[1] + p.qs.start - q[0], p.qs.stop - p.qs.start)  # the trimmed spans
    k = (p.ks.start, k[1] + p.ks.start - k[0], p.ks.stop - p.ks.start)
    if q[2] <= tile and k[2] <= tile:
        p = _tile(q, k, lo, hi, q_ids, k_ids)
        if p is not None:
            out.append(p)
        return
    for qh in _halves(q, tile):
        for kh in _halves(k, tile):
            _quad(qh, kh, lo, hi, q_ids, k_ids, tile, out)


def _merge(pieces: list[Piece], k_barrier: int | None) -> list[Piece]:
    """Merge whole pieces side by side: same rows and adjacent keys (not across
    ``k_barrier``), then same keys and adjacent rows. Order: by rows, then keys."""
    def join(items, same, adjacent, make):
        out = []
        for p in items:
            if out and out[-1].whole and p.whole and same(out[-1], p) and adjacent(out[-1], p):
                out[-1] = make(out[-1], p)
            else:
                out.append(p)
        return out

    rows = join(sorted(pieces, key=lambda p: (p.qs.start, p.ks.start)),
                lambda a, b: a.qs == b.qs,
                lambda a, b: a.ks.stop == b.ks.start and a.ks.stop != k_barrier,
                lambda a, b: Piece(a.qs, slice(a.ks.start, b.ks.stop)))
    cols = join(sorted(rows, key=lambda p: (p.ks.start, p.ks.stop, p.qs.start)),
                lambda a, b: a.ks == b.ks,
                lambda a, b: a.qs.stop == b.qs.start,
                lambda a, b: Piece(slice(a.qs.start, b.qs.stop), a.ks))
    return sorted(cols, key=lambda p: (p.qs.start, p.ks.start))


def _increasing(spans) -> bool:
    return all(b[1] >= a[1] + a[2] for a, b in zip(spans, spans[1:]))


def block_pieces(q_spans, k_spans, lo: int | None, hi: int | None, q_ids=None, k_ids=None,
                 tile: int | None = None, merge_diagonal: bool = True,
                 k_barrier: int | None = None) -> list[Piece]:
    """THE visibility decision: the kernel calls that cover exactly the visible pairs of a
    query block (spans ``q_spans``, document ids ``q_ids`` [B, Sq] or None) against a key
    block (``k_spans``, ``k_ids``), under ``bounds`` (lo, hi). Empty list: skip the block.

    ``tile``: the smallest piece a masked span pair is cut into (``tile_size``), and the
    shortest document run planned on its own (``_doc_runs``); None: no cutting (causal
    order alone); ``merge_diagonal``: a block
    against itself under plain causal order is one causal call; ``k_barrier``: no merged
    call crosses this key offset (the ring's backward splits its diagonal there).
    """
    if (merge_diagonal and q_ids is None and lo == 0 and q_spans == k_spans
            and _increasing(q_spans)):
        last = q_spans[-1]
        extent = last[1] + last[2] - q_spans[0][1]  # first to last position
        if hi is None or hi >= extent - 1:
            size = last[0] + last[2]
            return [Piece(slice(0, size), slice(0, size), causal=True)]
    pieces: list[Piece] = []
    if q_ids is None or tile is None:
        for q in q_spans:
            for k in k_spans:
                _quad(q, k, lo, hi, q_ids, k_ids, tile, pieces)
        return _merge(pieces, k_barrier)
    for q, qdoc in _doc_runs(q_spans, q_ids, tile):
        for k, kdoc in _doc_runs(k_spans, k_ids, tile):
            if qdoc is not None and qdoc == kdoc:  # one document, in every batch row
                _quad(q, k, lo, hi, None, None, tile, pieces)  # the positions decide alone
            elif qdoc is None or kdoc is None or any(a == b for a, b in zip(qdoc, kdoc)):
                _quad(q, k, lo, hi, q_ids, k_ids, tile, pieces)
    return _merge(pieces, k_barrier)


def _doc_runs(spans, ids: torch.Tensor, tile: int) -> list[tuple[Span, tuple | None]]:
    """``spans`` cut where the document ids ``ids`` [B, block len] change in some batch
    row: each run of at least ``tile`` tokens is one document in every row (paired with
    its ids per row); shorter runs side by side stay one span (None: several documents,
    tiled by ``_quad``). A run never holds two documents' tokens, so a pair of runs is
    whole, causal, masked by the window alone or skipped, with no document mask."""
    cut = ((ids[:, 1:] != ids[:, :-1]).any(0).nonzero().flatten() + 1).tolist()  # offsets
    runs = []
    for off, start, n in spans:
        edges = [off] + [c for c in cut if off < c < off + n] + [off + n]
        firsts = ids[:, edges[:-1]].T.tolist()  # [runs][B]: each run's ids
        short = None  # (first offset, end offset) of the short runs gathered so far
        for a, b, doc in zip(edges, edges[1:], firsts):
            if b - a < tile:
                short = (short[0] if short else a, b)
                continue
            if short:
                runs.append(((short[0], start + short[0] - off, short[1] - short[0]), None))
                short = None
            runs.append(((a, start + a - off, b - a), tuple(doc)))
        if short:
            runs.append(((short[0], start + short[0] - off, short[1] - short[0]), None))
    return runs


def _asked(segment_ids, window) -> list[str]:
    return [k for k, v in zip(MASK_KINDS, (window, segment_ids)) if v is not None]


def check_masks(segment_ids, window, *, batch: int, seq_len: int, device,
                kernel="torch", ring_impl: str = "usp") -> None:
    """Refuse masks that cannot work, before any collective (ValueError naming a fix).

    ``segment_ids``: LongTensor [batch, seq_len] on ``device`` (``seq_len``: the tokens
    this call holds, L/P under sequence parallelism); ``window``: a positive int; both need
    a kernel that takes them (``supported_masks``) and ``ring_impl='usp'``.
    """
    if window is not None and (isinstance(window, bool) or not isinstance(window, int)
                               or window < 1):
        raise ValueError(f"window={window!r}: a query at i sees keys j with 0 <= i - j < window, "
                         f"so window must be a positive int; use window=None for full attention")
    if segment_ids is not None:
        if not isinstance(segment_ids, torch.Tensor) or segment_ids.dtype != torch.long:
            what = segment_ids.dtype if isinstance(segment_ids, torch.Tensor) else type(segment_ids)
            raise ValueError(f"segment_ids must be a LongTensor (document id per token), got "
                             f"{what}; pass segment_ids.long()")
        if tuple(segment_ids.shape) != (batch, seq_len):
            raise ValueError(f"segment_ids{tuple(segment_ids.shape)} must be [batch, local "
                             f"length] = [{batch}, {seq_len}], one id per token of q; shard the "
                             f"global [B, L] ids with layout.shard(ids, dim=1)")
        if segment_ids.device != torch.device(device):
            raise ValueError(f"segment_ids are on {segment_ids.device} but q is on {device}; "
                             f"move them with segment_ids.to(q.device)")
    asked = _asked(segment_ids, window)
    if not asked:
        return
    if ring_impl != "usp":
        raise ValueError(f"ring_impl={ring_impl!r} cannot apply {' or '.join(asked)} (its ring "
                         f"computes causal or full blocks only); use ring_impl='usp'")
    able = supported_masks(kernel)
    missing = [k for k in asked if k not in able]
    if missing:
        name = kernel if isinstance(kernel, str) else type(kernel).__name__
        raise ValueError(f"kernel {name!r} cannot apply {' and '.join(missing)} (it takes "
                         f"{sorted(able) or 'no masks'}); use kernel='torch' or 'reference'")


def gather_segment_ids(segment_ids: torch.Tensor, layout) -> torch.Tensor:
    """This rank's [B, L/P] ids -> the global [B, L] on every SP rank (collective over the
    SP group; its bytes are recorded under "sp")."""
    if layout.mesh.sp_size == 1:
        return segment_ids
    return layout.gather(segment_ids, dim=1)
