"""Feasibility rules for a sequence-parallel layout.

Pure functions, no process group: they run before anything is launched and raise
``ValueError`` with the offending numbers and a fix. The mesh, the layout, the attention
call and the planner all use these, so each rule is written once.
"""

from __future__ import annotations

BALANCES = ("contiguous", "zigzag")
PLACEMENTS = ("ulysses_inner", "ring_inner")


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


def check_heads(num_q_heads: int, num_kv_heads: int, ulysses: int) -> int:
    """Check that the head counts split over the ulysses group.

    Returns the number of KV heads each ulysses rank receives: ``num_kv_heads / ulysses``
    when the KV heads split evenly, or 1 when ``ulysses`` is a multiple of the KV heads
    (each KV head then goes to ``ulysses / num_kv_heads`` ranks, replicated only that far).
    """
    if num_q_heads < 1 or num_kv_heads < 1:
        raise ValueError(f"head counts must be positive, got q={num_q_heads}, kv={num_kv_heads}")
    if num_q_heads % num_kv_heads != 0:
        raise ValueError(
            f"query heads ({num_q_heads}) must be a multiple of KV heads ({num_kv_heads})"
        )
    if num_q_heads % ulysses != 0:
        ok = [u for u in _divisors(num_q_heads) if num_kv_heads % u == 0 or u % num_kv_heads == 0]
        raise ValueError(
            f"query heads ({num_q_heads}) are not divisible by ulysses degree ({ulysses}); "
            f"use ulysses in {_nearest(ok, ulysses)} and move the rest of the parallelism to ring"
        )
    if num_kv_heads % ulysses == 0:
        return num_kv_heads // ulysses
    if ulysses % num_kv_heads == 0:
        return 1
    ok = [u for u in _divisors(num_q_heads) if num_kv_heads % u == 0 or u % num_kv_heads == 0]
    raise ValueError(
        f"KV heads ({num_kv_heads}) and ulysses degree ({ulysses}) must divide one another "
        f"so each rank gets whole KV groups; use ulysses in {_nearest(ok, ulysses)}"
    )


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


def check_placement(placement: str) -> None:
    if placement not in PLACEMENTS:
        raise ValueError(f"placement must be one of {PLACEMENTS}, got {placement!r}")
