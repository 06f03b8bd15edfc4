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
  head a call.
- ``norm_tiles``: a norm's backward holds six fp32 values an element of its input
  (measured); over sequence tiles it holds one tile's. At least the tiles asked for
  (``model.norm_tiles``), more while one tile's work would pass ``NORM_BYTES``.

Short sequences stay whole: both limits are met by one call and one tile until a rank holds
tens of thousands of tokens.
"""

from __future__ import annotations

from .counts import even_counts

FP32 = 4
CALL_BYTES = 1 << 30  # one attention backward kernel call's transient bytes, at most
NORM_BYTES = 1 << 30  # one norm tile's backward work, at most
NORM_WORK = 6 * FP32  # bytes of a norm's backward work per element of its input (measured)


def call_bytes(sq: int, sk: int, hq: int, hkv: int, d: int, dtype_bytes: int) -> float:
    """Transient bytes of one backward kernel call over ``sq`` query rows of ``hq`` heads
    against ``sk`` keys of ``hkv`` heads: its dq, dk, dv (``dtype_bytes``), flash-attention
    2's fp32 dq accumulator and row sums (``softmax_d``), and, when ``hq > hkv``, its dK/dV
    expanded to the ``hq`` heads before their sum (the head dim as given; the kernel rounds
    it up to a multiple of 32 for the accumulator)."""
    a = dtype_bytes
    out = sq * hq * d * a + 2 * sk * hkv * d * a
    work = sq * hq * (d + 1) * FP32
    expanded = 2 * sk * hq * d * a if hq > hkv else 0
    return out + work + expanded


def head_groups(hq: int, hkv: int, parts: int) -> list[tuple[range, range]]:
    """(query heads, KV heads) of each call when a rank's ``hq`` query heads and ``hkv`` KV
    heads (local query head i uses KV head ``i // (hq // hkv)``) are cut into ``parts``
    calls: KV heads in near-equal runs with their query heads while ``parts <= hkv``; else
    each KV head's query heads in ``ceil(parts / hkv)`` near-equal runs (at most one head
    each), every run with its one KV head."""
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


def backward_head_groups(sq: int, sk: int, hq: int, hkv: int, d: int, dtype_bytes: int,
                         limit: float | None = None) -> list[tuple[range, range]]:
    """The fewest calls (``head_groups``; parts 1, 2, 4, ... up to one query head a call)
    whose largest stays within ``limit`` bytes (``call_bytes``; default ``CALL_BYTES``);
    one query head a call when none does."""
    limit = CALL_BYTES if limit is None else limit
    parts = 1
    while True:
        groups = head_groups(hq, hkv, parts)
        worst = max(call_bytes(sq, sk, len(qh), len(kh), d, dtype_bytes) for qh, kh in groups)
        if worst <= limit or len(groups) == hq:
            return groups
        parts = min(2 * parts, hq)


def group_bytes(sq: int, sk: int, hq: int, hkv: int, d: int, dtype_bytes: int,
                limit: float | None = None) -> float:
    """The largest call's bytes under ``backward_head_groups``, plus the fp32 dK/dV of one
    KV head the caller sums a split KV head's parts in (when one is split)."""
    groups = backward_head_groups(sq, sk, hq, hkv, d, dtype_bytes, limit)
    worst = max(call_bytes(sq, sk, len(qh), len(kh), d, dtype_bytes) for qh, kh in groups)
    split = len(groups) > hkv
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
