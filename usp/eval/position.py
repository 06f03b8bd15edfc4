"""Loss by position: each position's loss over validation windows, summed into equal
position buckets and weighted by tokens (a bucket's loss is the mean over all its scored
tokens of all windows). No torch: the runner sums each position's loss and count."""

from __future__ import annotations

from typing import Sequence


def bucket_edges(length: int, buckets: int) -> list[int]:
    """``buckets + 1`` edges splitting positions 0..length-1 into buckets whose sizes differ
    by at most one (fewer buckets than positions: as many as there are positions)."""
    b = min(buckets, length)
    return [length * i // b for i in range(b + 1)]


def bucket_losses(loss_sum: Sequence[float], count: Sequence[float], buckets: int) -> list[float]:
    """Mean loss per bucket from per-position sums ``loss_sum`` and token ``count`` ([L]
    each, over all windows): sum of losses / sum of tokens in the bucket (NaN when empty)."""
    edges = bucket_edges(len(loss_sum), buckets)
    out = []
    for lo, hi in zip(edges[:-1], edges[1:]):
        n = sum(count[lo:hi])
        out.append(sum(loss_sum[lo:hi]) / n if n else float("nan"))
    return out
