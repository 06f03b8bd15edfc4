"""Bytes one ``usp_attention`` call sends per rank: the one comm-volume formula.

The planner's cost model prices these bytes, and ``tests/distributed/test_comm_volume.py`` checks the
``CommStats`` that real calls record against them, so the planner is tied to real traffic.

Heads per ulysses rank come from ``usp.dims.heads.head_split``: rank j computes ``q_j`` query
heads and receives ``kv_j`` KV heads (Hq/u and max(Hkv/u, 1) when the heads divide).
Ulysses, rank i, per token of a peer's chunk (``n = L/P`` tokens per rank): the fused
q/k/v all-to-all sends ``q_j + 2 kv_j`` heads to each peer j; the output all-to-all sends
its own ``q_i`` heads to each of the u-1 peers. Backward mirrors both: ``q_j`` heads to each
peer j (the output's grads), ``q_i + 2 kv_i`` to each peer (dq, dk, dv). Ring: r-1 hops of
a K+V block [B, L/r, kv_i, d] forward; backward the same K/V hops plus r-1 hops of the fp32
dK+dV accumulator (each block's accumulator starts at the rank after its owner and ends at
the owner).

With ``a2a_chunks = c > 1`` (``usp_attention``'s pipelined all-to-alls) the ulysses bytes
are the same, in c times as many messages; the ring runs once per stage
(``usp.dims.stages.head_chunks``), so a KV head that serves several stages of a rank (fewer
KV heads on the rank than stages) travels the ring once per stage it serves.

Attention sinks (``usp_attention(sinks=...)``) add no byte: every rank holds the [Hq] logits
already and folds them in after the ring's last merge; each rank keeps its share of their
gradient, which the training step's gradient reduction sums with every other parameter's.
"""

from __future__ import annotations

from ..dims.stages import head_chunks
from ..dims.heads import head_split

FP32 = 4


def ring_kv_heads(hq: int, hkv: int, ulysses: int, rank: int, a2a_chunks: int = 1) -> int:
    """KV heads ulysses rank ``rank`` sends round the ring per hop, summed over its pipeline
    stages: its KV heads, plus one more for each extra stage a KV head serves."""
    split = head_split(hq, hkv, ulysses)
    if a2a_chunks == 1 or ulysses == 1:
        return split.kv_counts[rank]
    return sum(s.kv[1] - s.kv[0] for s in head_chunks(split, a2a_chunks)[rank])


def attention_bytes(batch: int, seq_len: int, hq: int, hkv: int, head_dim: int, ulysses: int,
                    ring: int, elem_bytes: int, rank: int | None = None,
                    a2a_chunks: int = 1) -> tuple[dict, dict]:
    """({"ulysses": bytes, "ring": bytes} forward, the same backward) sent by ulysses rank
    ``rank``; ``rank=None``: each entry's maximum over the ulysses ranks (the slowest
    rank, which the planner prices; equal to every rank's bytes when the heads divide).
    ``a2a_chunks``: the pipeline stages of the ulysses all-to-alls (see the module)."""
    u, r = ulysses, ring
    split = head_split(hq, hkv, u)
    if rank is None:
        per_rank = [attention_bytes(batch, seq_len, hq, hkv, head_dim, u, r, elem_bytes, j,
                                    a2a_chunks) for j in range(u)]
        return tuple({a: max(p[i][a] for p in per_rank) for a in ("ulysses", "ring")}
                     for i in (0, 1))
    if not 0 <= rank < u:
        raise ValueError(f"rank {rank} is not a ulysses coordinate; use 0..{u - 1} or None")
    qc, kc = split.q_counts, split.kv_counts
    n, s = seq_len // (u * r), seq_len // r  # tokens per rank, per ring segment
    token = batch * n * head_dim * elem_bytes  # one head of one peer's chunk
    peers = [j for j in range(u) if j != rank]
    fwd_a2a = sum(qc[j] + 2 * kc[j] for j in peers) + (u - 1) * qc[rank]
    bwd_a2a = sum(qc[j] for j in peers) + (u - 1) * (qc[rank] + 2 * kc[rank])
    ring_kv = ring_kv_heads(hq, hkv, u, rank, a2a_chunks)
    kv_block = 2 * batch * s * ring_kv * head_dim * elem_bytes
    acc_block = 2 * batch * s * ring_kv * head_dim * FP32
    fwd = {"ulysses": fwd_a2a * token, "ring": (r - 1) * kv_block}
    bwd = {"ulysses": bwd_a2a * token, "ring": (r - 1) * (kv_block + acc_block)}
    return fwd, bwd


def windowed_ring_hops(seq_len: int, ring: int, balance: str, causal: bool,
                       window: int | None) -> int:
    """K/V hops of the usp ring per pass when queries see only ``window`` tokens (``window``
    as in ``usp_attention``; None: r - 1).

    The ring sends one way, so a block from ring rank i - s arrives after s hops. Causal,
    contiguous: a query's keys reach ``window - 1`` tokens back, into the
    ceil((window - 1) / (L/r)) segments before its own. Zigzag: the second chunk of ring
    rank i (chunk 2r-1-i) follows the second chunk of rank i + 1, which is r - 1 hops
    away, so any window of 2 or more needs every hop (per_document likewise, each document
    cut head-tail as a zigzag row is); not causal likewise (the next
    segment is r - 1 hops away). ``usp.ring.ring_hops`` derives the same from the plan.
    """
    r = ring
    if r == 1 or window == 1:
        return 0
    if window is None or window >= seq_len or balance != "contiguous" or not causal:
        return r - 1
    seg = seq_len // r
    return min(r - 1, -(-(window - 1) // seg))


def band_share(seq_len: int, window: int | None, causal: bool = True) -> float:
    """The share of a full layer's attention work (the causal triangle, or the square) that a
    layer whose queries see only ``window`` tokens does: its band, L*w - w^2/2 of L^2/2
    (not causal: 2*L*w - w^2 of L^2, about). 1 without a window or when it spans L."""
    L = seq_len
    if window is None or window >= L:
        return 1.0
    band = L * window - window * window / 2
    return band / (L * L / 2) if causal else min(1.0, 2 * band / (L * L))


def layer_windows(model, seq_len: int) -> list[tuple[int, int | None]]:
    """(layers, window) for each window the layers of ``model`` have (None: full attention;
    a window of ``seq_len`` or more counts as full), full layers first: what the planner
    prices layer by layer (a local layer's attention costs its band, ``band_share``)."""
    counts: dict[int | None, int] = {}
    for i in range(model.n_layers):
        w = model.layer_window(i)
        key = None if w is None or w >= seq_len else w
        counts[key] = counts.get(key, 0) + 1
    return sorted(((n, w) for w, n in counts.items()), key=lambda x: (x[1] is not None, x[1] or 0))


def masked_attention_bytes(batch: int, seq_len: int, hq: int, hkv: int, head_dim: int,
                           ulysses: int, ring: int, elem_bytes: int, *, balance: str,
                           causal: bool, window: int | None = None, segment_ids: bool = False,
                           rank: int | None = None, a2a_chunks: int = 1) -> tuple[dict, dict]:
    """``attention_bytes`` for a call with masks: ({"ulysses", "ring", "sp"} forward, the
    same backward). The ring makes ``windowed_ring_hops`` hops instead of r - 1 (K/V each
    pass, the fp32 dK/dV accumulators in backward); ``segment_ids`` adds the forward's
    all-gather of the int64 ids over the SP group: each rank's [B, L/P] to P - 1 peers."""
    fwd, bwd = attention_bytes(batch, seq_len, hq, hkv, head_dim, ulysses, ring, elem_bytes, rank,
                               a2a_chunks)
    if ring > 1:
        hops = windowed_ring_hops(seq_len, ring, balance, causal, window)
        fwd["ring"] = fwd["ring"] // (ring - 1) * hops
        bwd["ring"] = bwd["ring"] // (ring - 1) * hops
    p = ulysses * ring
    fwd["sp"] = batch * (seq_len // p) * 8 * (p - 1) if segment_ids else 0
    bwd["sp"] = 0
    return fwd, bwd


def layer_mean_bytes(model, seq_len: int, ulysses: int, ring: int, elem_bytes: int,
                     balance: str, causal: bool, a2a_chunks: int = 1) -> dict:
    """{"ulysses", "ring"}: the bytes one rank sends for one sequence in one layer, forward
    and backward, the mean over ``model``'s layers (a local layer's ring makes
    ``windowed_ring_hops`` hops; ``layer_windows``)."""
    out = {"ulysses": 0.0, "ring": 0.0}
    for n, w in layer_windows(model, seq_len):
        f, b = masked_attention_bytes(1, seq_len, model.n_heads, model.n_kv_heads,
                                      model.head_dim, ulysses, ring, elem_bytes, balance=balance,
                                      causal=causal, window=w, a2a_chunks=a2a_chunks)
        for link in out:
            out[link] += n * (f[link] + b[link]) / model.n_layers
    return out
