"""Which samples a dp rank draws: the one rule every dataset and the trainer follow, and the
batches held out for evaluation."""

from __future__ import annotations

HELD_OUT_BATCH = 10**6  # batch numbers from here on are held out: evaluation's, no step's


def sample_indices(first: int, batch_per_dp_rank: int, dp_rank: int) -> range:
    """Global sample ids of ``dp_rank``'s share of the batch that starts at sample ``first``.

    The batch is ``batch_per_dp_rank`` samples per dp rank; dp rank r takes
    ``first + r * batch_per_dp_rank + i``, so the dp ranks split each batch and the batch is
    the same for any dp split of it. Batch number ``step`` of ``dp_size`` ranks starts at
    ``step * batch_per_dp_rank * dp_size``. Each dataset draws a sample from (seed, its id)
    alone.
    """
    start = first + dp_rank * batch_per_dp_rank
    return range(start, start + batch_per_dp_rank)


def step_indices(step: int, batch_per_dp_rank: int, dp_rank: int, dp_size: int) -> range:
    """``sample_indices`` of batch number ``step`` (``batch_per_dp_rank x dp_size`` samples
    a batch): sample i of ``dp_rank`` is ``(step * dp_size + dp_rank) * batch_per_dp_rank + i``."""
    return sample_indices(step * batch_per_dp_rank * dp_size, batch_per_dp_rank, dp_rank)


def held_out_batch(i: int) -> int:
    """The batch number of held-out batch ``i`` (``HELD_OUT_BATCH + i``): evaluation draws
    it with ``model_batch``; the steps of a run reach it only after ``HELD_OUT_BATCH``
    batches of the same size."""
    return HELD_OUT_BATCH + i
