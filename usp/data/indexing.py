"""Which samples a dp rank draws at a step: the one rule every dataset follows."""

from __future__ import annotations


def sample_indices(step: int, batch_size: int, dp_rank: int, dp_size: int) -> range:
    """Global sample ids of ``dp_rank``'s batch at ``step`` (``batch_size`` per dp rank).

    Sample i is ``(step * dp_size + dp_rank) * batch_size + i``: steps never overlap, the
    dp ranks split each step's global batch, and the global batch is the same for any dp
    split of it. Each dataset draws a sample from (seed, its id) alone.
    """
    first = (step * dp_size + dp_rank) * batch_size
    return range(first, first + batch_size)
