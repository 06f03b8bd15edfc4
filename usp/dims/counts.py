"""One rule for cutting a count into near-equal parts, used by the stage split and the
message fragments alike."""

from __future__ import annotations


def even_counts(n: int, parts: int) -> list[int]:
    """``n`` split into ``parts`` near-equal counts, the larger first: 7 into 3 -> [3, 2, 2]."""
    return [n // parts + (i < n % parts) for i in range(parts)]
