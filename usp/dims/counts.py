"""One rule for cutting a count into near-equal parts, used by the stage split and the
message fragments alike; and a count's divisors, the degrees a world can take."""

from __future__ import annotations


def even_counts(n: int, parts: int) -> list[int]:
    """``n`` split into ``parts`` near-equal counts, the larger first: 7 into 3 -> [3, 2, 2]."""
    return [n // parts + (i < n % parts) for i in range(parts)]


def divisors(n: int) -> list[int]:
    """Every divisor of ``n``, ascending: 12 -> [1, 2, 3, 4, 6, 12]."""
    return [d for d in range(1, n + 1) if n % d == 0]
