"""Which samples a dp rank draws at a step: the one rule every dataset follows."""

from __future__ import annotations


def sample_indices(step: int, batch_per_dp_rank: int, dp_rank: int, dp_size: int) -> range:
    """Global sample ids of ``dp_rank``'s batch at ``step`` (``batch_per_dp_rank`` per dp rank).

    Sample i is ``(step * dp_size + dp_rank) * batch_per_dp_rank + i``: steps never overlap, the
    dp ranks split each step's global batch, and the global batch is the same for any dp
    split of it. Each dataset draws a sample from (seed, its id) alone.
    """
    first = (step * dp_size + dp_rank) * batch_per_dp_rank
    return range(first, first + batch_per_dp_rank)
