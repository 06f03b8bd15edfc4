"""How large one piece of work may be: the attention backward's head groups and a norm's
sequence tiles, decided from shapes alone so the model, the ring and the planner agree.

Both cut a computation whose transient memory grows with the tokens on a rank into parts
that are computed one after another, with the same result:

- ``backward_head_groups``: one attention backward kernel call over every query head of a
  rank holds, besides its gradients, the kernel's own fp32 dq accumulator and, with GQA,
  dK/dV expanded to the query heads (flash-attention 2's ``mha_bwd``, which PyTorch's flash
  op runs: ``call_bytes``). Calls over groups of heads hold one group's. A group is whole
  KV heads with their query heads while that fits ``CALL_BYTES``, else the query heads of
  one KV head in parts (their dK/dV then summed in fp32 by the caller), down to one query
  head a call. The rule takes one rank's own head counts (uneven ulysses splits differ by
  rank, ``usp.dims.heads.HeadSplit``; the planner prices the worst rank).
- ``norm_tiles``: a norm's backward holds six fp32 values an element of its input
  (measured); over sequence tiles it holds one tile's. At least the tiles asked for
  (``model.norm_tiles``), more while one tile's work would pass ``NORM_BYTES`` (per
  sequence row: B rows hold B tiles' work).

Short sequences stay whole: both limits are met by one call and one tile until a rank holds
tens of thousands of tokens.
"""

from __future__ import annotations

from .counts import even_counts

FP32 = 4
CALL_BYTES = 1 << 30  # one attention backward kernel call's transient bytes, at most
NORM_BYTES = 1 << 30  # one norm tile's backward work, at most
NORM_WORK = 6 * FP32  # bytes of a norm's backward work per element of its input (measured)


def call_bytes(sq: int, sk: int, hq: int, hkv: int, d: int, dtype_bytes: int,
               workspace: bool = True) -> float:
    """Transient bytes of one backward kernel call over ``sq`` query rows of ``hq`` heads
    against ``sk`` keys of ``hkv`` heads: its dq, dk, dv (``dtype_bytes``); with
    ``workspace`` (the flash kernels on CUDA) also contiguous copies of its q, dout, out, k
    and v (a head group's slices are strided: the flash adapters copy them),
    flash-attention 2's fp32 dq accumulator and row sums (``softmax_d``), and, when
    ``hq > hkv``, its dK/dV expanded to the ``hq`` heads before their sum (the head dim as
    given; the kernel rounds it up to a multiple of 32 for the accumulator)."""
    a = dtype_bytes
    grads = sq * hq * d * a + 2 * sk * hkv * d * a
    if not workspace:
        return grads
    copies = 3 * sq * hq * d * a + 2 * sk * hkv * d * a
    work = sq * hq * (d + 1) * FP32
    expanded = 2 * sk * hq * d * a if hq > hkv else 0
    return grads + copies + work + expanded


def head_groups(hq: int, hkv: int, parts: int) -> list[tuple[range, range]]:
    """(query heads, KV heads) of each call when a rank's ``hq`` query heads and ``hkv`` KV
    heads (local query head i uses KV head ``i // (hq // hkv)``) are cut into ``parts``
    calls: KV heads in near-equal runs with their query heads while ``parts <= hkv``; else
    each KV head's query heads in ``ceil(parts / hkv)`` near-equal runs (at most one head
    each), every run with its one KV head."""
    if hkv < 1 or hq % hkv:
        raise ValueError(f"head groups need query heads ({hq}) a multiple of KV heads ({hkv})")
    g = hq // hkv
    groups, start = [], 0
    if parts <= hkv:
        for n in even_counts(hkv, parts):
            groups.append((range(start * g, (start + n) * g), range(start, start + n)))
            start += n
        return groups
    per = min(g, -(-parts // hkv))
    for kv in range(hkv):
        for n in even_counts(g, per):
            groups.append((range(kv * g + start, kv * g + start + n), range(kv, kv + 1)))
            start += n
        start = 0
    return groups


def _parts(hq: int, hkv: int) -> list[int]:
    """Call counts tried, fewest first: 1, 2, 4, ... below ``hkv``, then ``hkv`` (every KV
    head whole), then ``hkv`` times 2, 4, ... query-head parts, then one query head a call."""
    out, p = [], 1
    while p < hkv:
        out.append(p)
        p *= 2
    out.append(hkv)
    per = 2
    while per < hq // hkv:
        out.append(hkv * per)
        per *= 2
    return out + ([hq] if hq > hkv else [])


def backward_head_groups(sq: int, sk: int, hq: int, hkv: int, d: int, dtype_bytes: int,
                         limit: float | None = None) -> list[tuple[range, range]]:
    """The fewest calls (``head_groups`` over ``_parts``) whose largest stays within
    ``limit`` bytes (``call_bytes``; default ``CALL_BYTES``); one query head a call when
    none does."""
    limit = CALL_BYTES if limit is None else limit
    for parts in _parts(hq, hkv):
        groups = head_groups(hq, hkv, parts)
        if max(call_bytes(sq, sk, len(qh), len(kh), d, dtype_bytes)
               for qh, kh in groups) <= limit:
            return groups
    return groups


def group_bytes(sq: int, sk: int, hq: int, hkv: int, d: int, dtype_bytes: int,
                one_call: bool, workspace: bool = True, limit: float | None = None) -> float:
    """The largest call's bytes (``call_bytes`` with or without ``workspace``) under
    ``backward_head_groups``; on the one-call path (``one_call``: a rank's whole block in
    one piece, ``usp.ring``'s ``_whole_grads``) plus the fp32 dK/dV of one KV head it sums a
    split KV head's parts in (when one is split; the ring adds them into its fp32
    accumulators instead)."""
    groups = backward_head_groups(sq, sk, hq, hkv, d, dtype_bytes, limit)
    worst = max(call_bytes(sq, sk, len(qh), len(kh), d, dtype_bytes, workspace)
                for qh, kh in groups)
    split = one_call and len(groups) > hkv
    return worst + (2 * sk * d * FP32 if split else 0)


def norm_tiles(asked: int, tokens: float, width: int, limit: float | None = None) -> int:
    """Sequence tiles of a norm over a row of ``tokens`` tokens of ``width`` elements each:
    at least ``asked``, doubled while a tile's backward work (``NORM_WORK`` bytes an
    element, per row) passes ``limit`` (default ``NORM_BYTES``); at most ``tokens``."""
    limit = NORM_BYTES if limit is None else limit
    tiles = max(1, asked)
    while tiles < tokens and NORM_WORK * width * tokens / tiles > limit:
        tiles *= 2
    return int(min(tiles, max(1, tokens)))
