"""The optimizer step's batch: micro-batches per step from ``trainer.global_batch_tokens``."""

from __future__ import annotations


def grad_accum_steps(tc, seq_len: int, batch_per_dp_rank: int, dp: int) -> int:
    """Micro-batches per optimizer step: ``trainer.global_batch_tokens`` T / (seq_len x
    batch_per_dp_rank x dp) when T is set (refused unless whole, with the nearest valid T,
    and refused beside a different ``trainer.grad_accum_steps``), else
    ``trainer.grad_accum_steps`` (default 1)."""
    if tc.global_batch_tokens is None:
        return tc.grad_accum_steps or 1
    micro = seq_len * batch_per_dp_rank * dp  # tokens of one micro-batch over all dp ranks
    k, rest = divmod(tc.global_batch_tokens, micro)
    if rest or not k:
        lo, hi = max(1, k) * micro, (k + 1) * micro
        near = f"{lo} (grad_accum_steps {max(1, k)})" + (
            f" or {hi} (grad_accum_steps {k + 1})" if k else "")
        raise ValueError(
            f"trainer.global_batch_tokens={tc.global_batch_tokens} is not a whole number of "
            f"micro-batches of data.seq_len {seq_len} x data.batch_per_dp_rank "
            f"{batch_per_dp_rank} x dp {dp} = {micro} tokens; the nearest valid values: {near}")
    if tc.grad_accum_steps is not None and tc.grad_accum_steps != k:
        raise ValueError(
            f"trainer.global_batch_tokens={tc.global_batch_tokens} means grad_accum_steps {k} "
            f"at data.seq_len {seq_len} x data.batch_per_dp_rank {batch_per_dp_rank} x dp {dp}, "
            f"but trainer.grad_accum_steps={tc.grad_accum_steps}; set one of the two")
    return k
