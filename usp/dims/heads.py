"""The head split: which query and KV heads each ulysses rank computes.

Pure (no process group): the planner prices a split with it, the ulysses exchange
(``usp.ulysses``) moves the heads it names.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from itertools import pairwise


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
