"""Feasibility rules for a sequence-parallel layout.

Pure functions, no process group: they run before anything is launched and raise
``ValueError`` with the offending numbers and a fix. The mesh, the layout, the attention
call and the planner all use these, so each rule is written once.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from itertools import pairwise

import torch

BALANCES = ("contiguous", "zigzag")
PLACEMENTS = ("ulysses_inner", "ring_inner")
RING_IMPLS = ("usp", "ring_flash_attn")
HALF_DTYPES = (torch.float16, torch.bfloat16)
FLASH_MAX_HEAD_DIM = 256  # flash attention (torch's and flash-attn's): d % 8 == 0, d <= 256


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _nearest(candidates: list[int], target: int) -> list[int]:
    return sorted(candidates, key=lambda c: (abs(c - target), c))[:3]


def check_degrees(world_size: int, ulysses: int, ring: int, dp: int | None = None) -> int:
    """Check ``dp * ring * ulysses == world_size``; return dp (derived when not given)."""
    for name, val in (("ulysses", ulysses), ("ring", ring), ("world_size", world_size)):
        if not isinstance(val, int) or val < 1:
            raise ValueError(f"{name} degree must be a positive integer, got {val!r}")
    sp = ulysses * ring
    if dp is None:
        if world_size % sp != 0:
            fits = [(u, world_size // u) for u in _divisors(world_size)]
            raise ValueError(
                f"ulysses ({ulysses}) x ring ({ring}) = {sp} does not divide world size "
                f"{world_size}; pick degrees whose product divides {world_size}, "
                f"e.g. (ulysses, ring) in {fits}"
            )
        return world_size // sp
    if dp < 1 or dp * sp != world_size:
        raise ValueError(
            f"dp ({dp}) x ring ({ring}) x ulysses ({ulysses}) = {dp * sp} != world size "
            f"{world_size}; set dp = world_size / (ring * ulysses) or leave it unset"
        )
    return dp


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


def seq_multiple(ulysses: int, ring: int, balance: str) -> int:
    """The number the global sequence length must be a multiple of."""
    if balance not in BALANCES:
        raise ValueError(f"balance must be one of {BALANCES}, got {balance!r}")
    return (2 if balance == "zigzag" else 1) * ring * ulysses


def check_seq_len(seq_len: int, ulysses: int, ring: int, balance: str) -> None:
    """Zigzag needs ``2 * ring * ulysses | L``; contiguous needs ``ring * ulysses | L``."""
    m = seq_multiple(ulysses, ring, balance)
    if seq_len < 1 or seq_len % m != 0:
        lo = max(m, seq_len // m * m)
        rule = "2 x ring x ulysses" if balance == "zigzag" else "ring x ulysses"
        raise ValueError(
            f"sequence length {seq_len} is not divisible by {rule} = {m} "
            f"(ulysses={ulysses}, ring={ring}, balance={balance}); "
            f"use seq_len {lo} or {lo + m}"
        )


def check_ranks_per_node(world_size: int, ranks_per_node: int | None,
                         name: str = "ranks_per_node") -> None:
    """Simulated nodes of ``ranks_per_node`` ranks must split the world evenly (None: real hosts)."""
    if ranks_per_node is not None and (ranks_per_node < 1 or world_size % ranks_per_node):
        raise ValueError(f"{name}={ranks_per_node} does not divide the {world_size} ranks into "
                         f"whole nodes; use a divisor of {world_size} or null")


def check_placement(placement: str) -> None:
    if placement not in PLACEMENTS:
        raise ValueError(f"placement must be one of {PLACEMENTS}, got {placement!r}")


def _check_head_dim(head_dim: int, who: str, max_dim: int | None) -> None:
    if head_dim < 1 or head_dim % 8:
        lo = max(8, head_dim // 8 * 8)
        raise ValueError(
            f"head dim {head_dim} is not a multiple of 8, which {who} needs; "
            f"use head dim {lo} or {lo + 8}"
        )
    if max_dim is not None and head_dim > max_dim:
        raise ValueError(
            f"head dim {head_dim} > {max_dim}, the largest {who} supports; use a head dim "
            f"<= {max_dim} (more heads of a smaller dim)"
        )


def check_ring_impl(
    ring_impl: str,
    device_type: str,
    dtype: torch.dtype,
    head_dim: int,
    causal: bool = True,
    balance: str = "zigzag",
) -> None:
    """Rules for the ring engine: ``usp`` runs anywhere; ``ring_flash_attn`` is the
    ring-flash-attn package (0.1.8) on flash-attn kernels."""
    if ring_impl not in RING_IMPLS:
        raise ValueError(f"ring_impl must be one of {RING_IMPLS}, got {ring_impl!r}")
    if ring_impl == "usp":
        return
    who = "ring_impl='ring_flash_attn'"
    if torch.device(device_type).type != "cuda":
        raise ValueError(
            f"{who} runs flash-attn CUDA kernels, but the tensors are on {device_type}; "
            f"use ring_impl='usp'"
        )
    if dtype not in HALF_DTYPES:
        raise ValueError(
            f"{who} needs float16 or bfloat16 tensors, got {dtype}; train in bf16 or use "
            f"ring_impl='usp'"
        )
    if balance == "zigzag" and not causal:
        raise ValueError(
            f"{who} with balance='zigzag' asserts causal=True (zigzag only balances causal "
            f"work); use balance='contiguous' or ring_impl='usp' for non-causal attention"
        )
    if balance == "contiguous" and dtype == torch.float16:
        raise ValueError(
            f"{who} with balance='contiguous' returns dq in bfloat16 (ring-flash-attn "
            f"0.1.8), losing float16 precision; use bfloat16, balance='zigzag' or "
            f"ring_impl='usp'"
        )
    _check_head_dim(head_dim, f"{who} (flash attention)", FLASH_MAX_HEAD_DIM)


def check_kernel(
    kernel: str,
    device_type: str,
    dtype: torch.dtype,
    head_dim: int,
    ring_impl: str = "usp",
    causal: bool = True,
    balance: str = "zigzag",
) -> None:
    """Check that ``kernel`` (and ``ring_impl``) can run q/k/v of ``dtype`` and ``head_dim``
    on ``device_type`` ("cpu", "cuda"), before anything is launched.

    CUDA: torch's and flash-attn's flash attention take fp16/bf16 with head dim a multiple
    of 8 up to 256; torch's efficient attention (kernel="torch", fp32) takes head dims in
    multiples of 8 here; neither takes fp64. ``reference`` runs anything.
    """
    from .kernels import KERNELS  # here, not at import: kernels may use these rules

    if kernel not in KERNELS:
        raise ValueError(f"unknown attention kernel {kernel!r}; choose one of {KERNELS}")
    device_type = torch.device(device_type).type
    if kernel == "flash_attn":
        if device_type != "cuda":
            raise ValueError(
                f"kernel='flash_attn' is CUDA only, but the tensors are on {device_type}; "
                f"use kernel='torch'"
            )
        if dtype not in HALF_DTYPES:
            raise ValueError(
                f"kernel='flash_attn' needs float16 or bfloat16 tensors, got {dtype}; "
                f"train in bf16 or use kernel='torch'"
            )
        _check_head_dim(head_dim, "kernel='flash_attn'", FLASH_MAX_HEAD_DIM)
    elif kernel == "torch" and device_type == "cuda":
        if dtype == torch.float64:
            raise ValueError(
                "kernel='torch' on CUDA has no float64 attention (flash and efficient "
                "attention take fp16/bf16/fp32); use float32 or kernel='reference'"
            )
        flash = dtype in HALF_DTYPES
        who = f"kernel='torch' on cuda with {dtype} ({'flash' if flash else 'efficient'} attention)"
        _check_head_dim(head_dim, who, FLASH_MAX_HEAD_DIM if flash else None)
    check_ring_impl(ring_impl, device_type, dtype, head_dim, causal, balance)
