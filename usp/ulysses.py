"""The ulysses all-to-all: "some tokens, all heads" <-> "all tokens of the segment, some heads".

Forward of attention uses ``SeqToHead`` (q, k, v in ONE fused all-to-all) and
``HeadToSeq`` (the output back). Each is the other's backward.

Heads: ulysses rank j computes the query heads ``head_split(Hq, Hkv, u).q_ranges[j]`` and
receives exactly the KV heads those use (``kv_heads[j]``). When the heads divide evenly
that is Hq/u query heads and max(Hkv/u, 1) KV heads per rank; otherwise the counts differ
between ranks (6 heads on 4 ranks: 2, 2, 1, 1). A KV head used by several ranks is sent to
each of them (replicated only that far) and its gradients are summed on the way home.

Send buffers are packed per destination as contiguous blocks ([q-block | k-block |
v-block] for each rank). When every rank sends and receives equal blocks the buffer is
[u, ...] and each tensor packs with one copy (``comm.all_to_all``); otherwise blocks are
copied one by one and sent with uneven split sizes (``all_to_all_v_start``): no padding, so no
byte is sent that the receiver does not use.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from itertools import pairwise
from math import prod

import torch
import torch.distributed as dist

from .comm import CommStats, InFlight, all_to_all_start, on_wire, piece_count, post_all_to_all


# ---- the head split: which heads each ulysses rank computes ---------------------------


@dataclass(frozen=True)
class HeadSplit:
    """Which heads each ulysses rank computes (``head_split`` makes it).

    Rank j computes query heads ``q_ranges[j] = (start, stop)`` and receives the KV heads
    ``kv_heads[j]`` (global ids, ascending): exactly those its query heads use, no more.
    Each rank's heads keep the kernels' GQA rule locally: local query head i uses local
    KV head ``i // (q_counts[j] // kv_counts[j])``.
    """

    num_q_heads: int
    num_kv_heads: int
    q_ranges: tuple[tuple[int, int], ...]
    kv_heads: tuple[tuple[int, ...], ...]

    @property
    def ulysses(self) -> int:
        return len(self.q_ranges)

    @property
    def q_counts(self) -> tuple[int, ...]:
        return tuple(b - a for a, b in self.q_ranges)

    @property
    def kv_counts(self) -> tuple[int, ...]:
        return tuple(len(kv) for kv in self.kv_heads)

    @property
    def even(self) -> bool:
        """Every rank holds as many query heads and as many KV heads as every other."""
        return len(set(self.q_counts)) == 1 and len(set(self.kv_counts)) == 1

    @property
    def imbalance(self) -> float:
        """Most query heads on one rank / mean per rank (1.0 when even): the attention
        compute of the slowest ulysses rank relative to an even split."""
        return max(self.q_counts) * self.ulysses / self.num_q_heads


def _kv_of_range(a: int, b: int, group: int) -> tuple[int, ...] | None:
    """KV heads used by query heads [a, b) when each KV head serves equally many of them
    (the local GQA rule), else None."""
    first, last = a // group, (b - 1) // group
    runs = {min(b, (g + 1) * group) - max(a, g * group) for g in range(first, last + 1)}
    return tuple(range(first, last + 1)) if len(runs) == 1 else None


def _tile(hq: int, u: int, pieces: dict, max_q: int, max_kv: int) -> list[int] | None:
    """Cuts 0 = c0 < ... < cu = hq into u pieces of <= max_q query heads and <= max_kv KV
    heads with the fewest KV heads in total (ties: larger pieces on lower ranks); None if
    no such tiling exists. ``pieces[(a, b)]``: KV heads of the valid piece [a, b)."""
    inf = float("inf")
    best = [[inf] * (hq + 1) for _ in range(u + 1)]  # best[j][b]: j pieces cover [0, b)
    prev = [[0] * (hq + 1) for _ in range(u + 1)]
    best[0][0] = 0
    for j in range(1, u + 1):
        for b in range(j, hq + 1):
            for a in range(b - 1, max(j - 1, b - max_q) - 1, -1):  # later cut wins ties
                kv = pieces.get((a, b))
                if kv is None or len(kv) > max_kv or best[j - 1][a] + len(kv) >= best[j][b]:
                    continue
                best[j][b], prev[j][b] = best[j - 1][a] + len(kv), a
    if best[u][hq] == inf:
        return None
    cuts = [hq]
    for j in range(u, 0, -1):
        cuts.append(prev[j][cuts[-1]])
    return cuts[::-1]


@lru_cache(maxsize=256)
def head_split(num_q_heads: int, num_kv_heads: int, ulysses: int) -> HeadSplit:
    """The one rule for dividing heads over the ulysses group.

    Each rank gets a contiguous range of query heads and exactly the KV heads that range
    uses; a range must keep the local GQA rule (every KV head in it serves equally many of
    its query heads), so a range either lies inside one KV group, straddles two groups with
    equal halves, or holds whole groups. Among such splits it takes, in order: the fewest
    query heads on the busiest rank (attention compute), the fewest KV heads on the rank
    that receives most (ring and all-to-all bytes), the fewest KV heads in total; ties put
    the larger ranges on the lower ranks. When the heads divide evenly this is the plain
    even split (``hq/u`` query heads, ``max(hkv/u, 1)`` KV heads per rank).

    Examples: 28 query / 4 KV heads on 8 ranks: 4,3,4,3,... query heads, one KV head each;
    8/2 on 3 ranks: 3,2,3 query heads, the middle rank with both KV heads; 6/6 on 4 ranks:
    2,2,1,1. Raises ValueError when some rank would get no query head or the query heads
    are not a multiple of the KV heads.
    """
    hq, hkv, u = num_q_heads, num_kv_heads, ulysses
    if hq < 1 or hkv < 1:
        raise ValueError(f"head counts must be positive, got q={hq}, kv={hkv}")
    if hq % hkv != 0:
        raise ValueError(f"query heads ({hq}) must be a multiple of KV heads ({hkv})")
    if not isinstance(u, int) or u < 1:
        raise ValueError(f"ulysses degree must be a positive integer, got {u!r}")
    if u > hq:
        raise ValueError(
            f"ulysses degree ({u}) > query heads ({hq}): every ulysses rank needs at least "
            f"one query head; use ulysses <= {hq} and move the rest of the parallelism to ring"
        )
    group = hq // hkv
    pieces = {(a, b): kv for a in range(hq) for b in range(a + 1, hq + 1)
              if (kv := _kv_of_range(a, b, group)) is not None}
    for max_q in sorted({b - a for a, b in pieces if (b - a) * u >= hq}):
        if _tile(hq, u, pieces, max_q, hkv) is None:
            continue
        cuts = next(c for k in range(1, hkv + 1) if (c := _tile(hq, u, pieces, max_q, k)))
        ranges = tuple(pairwise(cuts))
        return HeadSplit(hq, hkv, ranges, tuple(pieces[r] for r in ranges))
    raise AssertionError("unreachable: whole KV groups or pieces of one group always tile")


def check_heads(num_q_heads: int, num_kv_heads: int, ulysses: int) -> int:
    """Check that the heads can be divided over the ulysses group (``head_split``).

    Returns the most KV heads any ulysses rank receives: ``num_kv_heads / ulysses`` when
    the KV heads split evenly, 1 when ``ulysses`` is a multiple of the KV heads (each KV
    head then goes to the ranks whose query heads use it, replicated only that far).
    """
    return max(head_split(num_q_heads, num_kv_heads, ulysses).kv_counts)


def head_imbalance(num_q_heads: int, num_kv_heads: int, ulysses: int) -> float:
    """Most query heads on one ulysses rank / mean per rank for ``head_split``'s split:
    1.0 when the heads divide evenly (6 heads on 4 ranks: 2 / 1.5 = 1.33). The busiest
    rank's attention compute is ``imbalance x Hq/u`` heads' worth."""
    return head_split(num_q_heads, num_kv_heads, ulysses).imbalance


@lru_cache(maxsize=64)
def kv_send_index(split: HeadSplit, device: torch.device) -> torch.Tensor | None:
    """The KV heads sent to ranks 0..u-1, concatenated: LongTensor [sum kv_counts] on
    ``device``; None when that is 0..Hkv-1 (each KV head goes to one rank, in order).

    Built once per split and device: a fresh index on every call of every layer would be
    a blocking host-to-device copy on CUDA.
    """
    heads = [h for kv in split.kv_heads for h in kv]
    if heads == list(range(split.num_kv_heads)):
        return None
    return torch.tensor(heads, dtype=torch.long, device=device)


@dataclass(frozen=True)
class HeadChunk:
    """One pipeline stage of one ulysses rank: global head ranges as (start, stop).

    ``q``: the query heads it computes; ``kv``: the KV heads they use; ``kv_first``: those
    of ``kv`` that no earlier stage of the rank used (they travel with this stage);
    ``kv_last``: those no later stage uses (their gradients travel back with this stage).
    """

    q: tuple[int, int]
    kv: tuple[int, int]
    kv_first: tuple[int, int]
    kv_last: tuple[int, int]


def _even(n: int, parts: int) -> list[int]:
    """``n`` split into ``parts`` near-equal counts, the larger first."""
    return [n // parts + (i < n % parts) for i in range(parts)]


def check_a2a_chunks(chunks, num_q_heads: int, num_kv_heads: int, ulysses: int) -> int:
    """Check a pipeline depth for the ulysses all-to-all; returns it. Raises ValueError
    unless 1 <= ``chunks`` <= the most query heads a ulysses rank holds (``head_split``)."""
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"a2a_chunks must be an integer >= 1, got {chunks!r}")
    most = max(head_split(num_q_heads, num_kv_heads, ulysses).q_counts)
    if chunks > most:
        raise ValueError(
            f"a2a_chunks={chunks} > {most} query heads per ulysses rank ({num_q_heads} query "
            f"heads over ulysses {ulysses}): a stage needs at least one head; use "
            f"a2a_chunks <= {most}")
    return chunks


# Stages of ``a2a_chunks="auto"`` when a ulysses group crosses hosts and no planner count is
# given, capped by the heads a rank holds: the measured best with one rank per core (the
# stand-in for one GPU per rank) across the simulated 300 mbit link (docs/measurements.md).
AUTO_STAGES_ACROSS_HOSTS = 4


def default_a2a_chunks(setting, crosses_hosts: bool, num_q_heads: int, num_kv_heads: int,
                       ulysses: int) -> int:
    """The pipeline depth a mesh's ``a2a_chunks`` setting means for these heads: an int is
    checked (``check_a2a_chunks``); ``"auto"`` is 1 when every ulysses group stays inside a
    host, else ``AUTO_STAGES_ACROSS_HOSTS`` or the most query heads a rank holds if fewer."""
    if setting != "auto":
        return check_a2a_chunks(setting, num_q_heads, num_kv_heads, ulysses)
    if not crosses_hosts or ulysses == 1:
        return 1
    most = max(head_split(num_q_heads, num_kv_heads, ulysses).q_counts)
    return min(AUTO_STAGES_ACROSS_HOSTS, most)


@lru_cache(maxsize=64)
def head_chunks(split: HeadSplit, chunks: int) -> tuple[tuple[HeadChunk, ...], ...]:
    """Each ulysses rank's heads cut into ``chunks`` pipeline stages: [rank][stage].

    Stages follow KV groups so each keeps the local GQA rule: with at least as many KV
    heads as stages a stage holds whole KV groups; with fewer, each KV group's query
    heads are cut into near-equal pieces (the KV head then serves several stages, and
    travels with the first). A rank with fewer query heads than stages gets empty stages.
    """
    out = []
    for (q0, q1), kv_heads in zip(split.q_ranges, split.kv_heads):
        nq, nkv, k0 = q1 - q0, len(kv_heads), kv_heads[0]
        g = nq // nkv  # local query heads per local KV head
        if nkv >= chunks:
            sizes = [n * g for n in _even(nkv, chunks)]
        else:
            sizes = [s for per_group in _even(chunks, nkv) for s in _even(g, per_group)]
        bounds, a = [], 0
        for n in sizes:  # local query ranges -> the local KV heads each uses
            bounds.append((a, a + n, a // g, -(-(a + n) // g) if n else a // g))
            a += n
        stages, seen = [], 0
        for t, (a, b, ka, kb) in enumerate(bounds):
            later = min([la for _, _, la, lb in bounds[t + 1:] if lb > la] or [kb])
            first = (max(ka, seen), max(kb, seen))  # not used by an earlier stage
            last = (ka, max(ka, min(kb, later)))  # not used by a later stage
            stages.append(HeadChunk((q0 + a, q0 + b), (k0 + ka, k0 + kb),
                                    (k0 + first[0], k0 + first[1]), (k0 + last[0], k0 + last[1])))
            seen = max(seen, kb)
        out.append(tuple(stages))
    return tuple(out)


def all_to_all_v_start(send: torch.Tensor, send_sizes: list[int], recv_sizes: list[int],
                       group: dist.ProcessGroup | None, to_group_rank: list[int] | None,
                       stats: CommStats, axis: str = "ulysses",
                       piece_bytes: int | None = None) -> InFlight:
    """Post an exchange of chunks of different sizes: ``send`` is 1-D, its chunk c
    (``send_sizes[c]`` elements, in coordinate order) goes to coordinate c. ``wait()``
    returns 1-D [sum recv_sizes], chunk c (``recv_sizes[c]`` elements) from coordinate c.
    ``to_group_rank`` as in ``comm.all_to_all``. Records the bytes sent to other ranks.
    ``piece_bytes``: cut the exchange into pieces so that no chunk's piece exceeds it
    (``comm.post_all_to_all``); every rank must then have the same largest chunk.
    """
    device = send.device
    if to_group_rank is not None:  # chunks in coordinate order -> in group-rank order
        by_rank = sorted(range(len(to_group_rank)), key=to_group_rank.__getitem__)
        chunks = send.split(send_sizes)
        send = torch.cat([chunks[c] for c in by_rank])
        send_sizes = [send_sizes[c] for c in by_rank]
        recv_sizes = [recv_sizes[c] for c in by_rank]
    wire = on_wire(send.contiguous(), group)
    own = send_sizes[dist.get_rank(group)]

    def finish(out: torch.Tensor) -> torch.Tensor:
        out = out.to(device)  # back from the host copy when staged, else a no-op
        if to_group_rank is not None:  # chunks in group-rank order -> in coordinate order
            chunks = out.split(recv_sizes)
            out = torch.cat([chunks[g] for g in to_group_rank])
        return out

    largest = max(*send_sizes, *recv_sizes) * wire.element_size()
    return post_all_to_all(wire, wire.new_empty(sum(recv_sizes)), group, stats, axis,
                           (wire.numel() - own) * wire.element_size(), finish,
                           recv_sizes, send_sizes, pieces=piece_count(largest, piece_bytes))


class _Axis:
    """The ulysses group as the all-to-all needs it, for one attention call.

    ``split`` is the call's ``head_split``: ``SeqToHead`` (or ``PipelinedAttention``) sets
    it from the q/k head counts and ``HeadToSeq`` reads it (one ``_Axis`` per call).
    ``piece_bytes``: the largest piece of one message to one peer (``comm.post_all_to_all``;
    the mesh's ``piece_bytes_for("ulysses")``), used when the split is even, so that every rank cuts
    its messages alike; None: messages go whole.
    """

    def __init__(self, size, group, to_group_rank, stats: CommStats,
                 piece_bytes: int | None = None):
        self.size, self.group, self.to_group_rank, self.stats = size, group, to_group_rank, stats
        self.piece_bytes = piece_bytes
        self.split: HeadSplit | None = None

    @property
    def _pieces(self) -> int | None:
        """``piece_bytes`` when every rank's blocks are alike (an even split), else None."""
        return self.piece_bytes if self.split is not None and self.split.even else None

    @property
    def rank(self) -> int:
        """This rank's ulysses coordinate."""
        g = dist.get_rank(self.group)
        return g if self.to_group_rank is None else self.to_group_rank.index(g)

    def exchange(self, send: list, recv: list[list[tuple[int, ...]]]) -> list[list[torch.Tensor]]:
        """Send block j of every part to coordinate j; return what each coordinate sent.

        send: parts, each indexed by destination: a [u, ...] tensor (equal blocks) or a
        list of u tensors. recv[p][i]: the shape of part p's block from coordinate i.
        Returns, per part, the u received blocks (views into the receive buffer).
        """
        return self.start(send, recv).wait()

    def start(self, send: list, recv: list[list[tuple[int, ...]]]) -> _Exchange:
        """``exchange`` posted without waiting: ``wait()`` on the result returns its blocks."""
        u = self.size
        if all(isinstance(p, torch.Tensor) for p in send) and all(
                len(set(shapes)) == 1 for shapes in recv):
            sizes = [p[0].numel() for p in send]
            buf = send[0].new_empty(u, sum(sizes))  # [u, q-block | k-block | v-block]
            off = 0
            for p, n in zip(send, sizes):
                buf[:, off : off + n].view(p.shape).copy_(p)
                off += n
            # [u(src), ...] back: per source, its [q | k | v] block
            return _Exchange(all_to_all_start(buf, self.group, self.to_group_rank, self.stats,
                                              piece_bytes=self._pieces), recv, None)
        send_sizes = [sum(p[j].numel() for p in send) for j in range(u)]
        buf = send[0][0].new_empty(sum(send_sizes))  # [q_0 k_0 v_0 | q_1 k_1 v_1 | ...]
        off = 0
        for j in range(u):
            for p in send:
                buf[off : off + p[j].numel()].view(p[j].shape).copy_(p[j])
                off += p[j].numel()
        recv_sizes = [sum(prod(shapes[i]) for shapes in recv) for i in range(u)]
        return _Exchange(all_to_all_v_start(buf, send_sizes, recv_sizes, self.group,
                                            self.to_group_rank, self.stats,
                                            piece_bytes=self._pieces), recv, recv_sizes)


class _Exchange:
    """An ``_Axis.start`` in flight; ``wait()`` returns, per part, the u received blocks."""

    def __init__(self, flight: InFlight, recv, recv_sizes: list[int] | None):
        self._flight, self._recv, self._sizes = flight, recv, recv_sizes

    def wait(self) -> list[list[torch.Tensor]]:
        got = self._flight.wait()
        sources = got.unbind(0) if self._sizes is None else got.split(self._sizes)
        out = [[] for _ in self._recv]
        for i, block in enumerate(sources):
            off = 0
            for p, shapes in enumerate(self._recv):
                n = prod(shapes[i])
                out[p].append(block[off : off + n].view(shapes[i]))
                off += n
        return out


def _by_heads(x: torch.Tensor, counts: tuple[int, ...]):
    """[B, L/P, H, d] -> head blocks of ``counts`` heads, block j destined for rank j:
    a [u, B, L/P, h, d] view when the counts are equal, else a list of u views."""
    b, n, _, d = x.shape
    if len(set(counts)) == 1:
        return x.reshape(b, n, len(counts), counts[0], d).permute(2, 0, 1, 3, 4)
    return list(x.split(counts, dim=2))


def _by_seq_chunk(y: torch.Tensor, u: int) -> torch.Tensor:
    """[B, L/r, h, d] -> [u, B, L/P, h, d]: sequence chunk j is destined for rank j (a view)."""
    b, s, h, d = y.shape
    return y.view(b, u, s // u, h, d).transpose(0, 1)


def _shapes(x: torch.Tensor, tokens: int, heads) -> list[tuple[int, ...]]:
    """Block shapes [B, tokens, h, d] for each head count in ``heads``."""
    return [(x.shape[0], tokens, h, x.shape[3]) for h in heads]


class SeqToHead(torch.autograd.Function):
    """(q [B, L/P, Hq, d], k, v [B, L/P, Hkv, d]) -> (q [B, L/r, q_j, d], k, v [B, L/r, kv_j, d])
    for ulysses rank j (``head_split``'s counts)."""

    @staticmethod
    def forward(ctx, q, k, v, axis: _Axis):
        u, me, n = axis.size, axis.rank, q.shape[1]
        split = head_split(q.shape[2], k.shape[2], u)
        index = kv_send_index(split, q.device)
        if index is not None:  # [B, L/P, Hkv, d] -> [B, L/P, sum kv_j, d]: the heads each rank needs
            k, v = k.index_select(2, index), v.index_select(2, index)
        qc, kc = split.q_counts, split.kv_counts
        recv = [_shapes(q, n, [qc[me]] * u), _shapes(k, n, [kc[me]] * u)]
        axis.split = split
        parts = axis.exchange([_by_heads(q, qc), _by_heads(k, kc), _by_heads(v, kc)],
                              recv + recv[1:])
        ctx.axis, ctx.split, ctx.kv_index = axis, split, index
        # per source i: [B, L/P, heads, d] -> [B, L/r, heads, d] (source i holds chunk i)
        return tuple(torch.cat(p, dim=1) for p in parts)

    @staticmethod
    def backward(ctx, dq, dk, dv):
        axis, split = ctx.axis, ctx.split
        u, n = axis.size, dq.shape[1] // axis.size
        recv = [_shapes(dq, n, split.q_counts), _shapes(dk, n, split.kv_counts)]
        gq, gk, gv = axis.exchange([_by_seq_chunk(g.contiguous(), u) for g in (dq, dk, dv)],
                                   recv + recv[1:])  # per source j: its heads, my tokens
        dq_full, dk_full, dv_full = (torch.cat(g, dim=2) for g in (gq, gk, gv))
        if ctx.kv_index is not None:  # sum the grads of a KV head's replicas back into it
            b, _, _, d = dk_full.shape
            hkv = split.num_kv_heads
            dk_full = dk_full.new_zeros(b, n, hkv, d).index_add_(2, ctx.kv_index, dk_full)
            dv_full = dv_full.new_zeros(b, n, hkv, d).index_add_(2, ctx.kv_index, dv_full)
        return dq_full, dk_full, dv_full, None  # [B, L/P, Hq | Hkv, d]


class HeadToSeq(torch.autograd.Function):
    """out [B, L/r, q_j, d] -> [B, L/P, Hq, d], after ``SeqToHead`` on the same ``axis``."""

    @staticmethod
    def forward(ctx, out, axis: _Axis):
        u, split = axis.size, axis.split
        ctx.axis, ctx.split = axis, split
        n = out.shape[1] // u
        (y,) = axis.exchange([_by_seq_chunk(out.contiguous(), u)],
                             [_shapes(out, n, split.q_counts)])
        return torch.cat(y, dim=2)  # per source j: [B, L/P, q_j, d] -> [B, L/P, Hq, d]

    @staticmethod
    def backward(ctx, grad):
        axis, split = ctx.axis, ctx.split
        me, n = axis.rank, grad.shape[1]
        (g,) = axis.exchange([_by_heads(grad, split.q_counts)],
                             [_shapes(grad, n, [split.q_counts[me]] * axis.size)])
        return torch.cat(g, dim=1), None  # [B, L/r, q_j, d]
