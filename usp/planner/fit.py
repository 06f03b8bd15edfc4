"""The longest sequence one layout holds: ``max_seq_len`` (the model's tilings as set) and
``longest_seq_len`` (an ``auto`` ``loss_chunk``/``mlp_tiles``/``norm_tiles`` re-sized at
every length tried, ``tiles.size_tiles``, and the node's host memory), both by
``largest_multiple``'s search, whose ``fits`` stays in this module."""

from __future__ import annotations

from ..config import ModelConfig
from ..config.cluster import ClusterSpec
from ..rules import seq_multiple
from .memory import memory_split
from .offload import host_bytes
from .options import StepPolicy


def longest_seq_len(model: ModelConfig, budget: float, dp: int, ring: int, ulysses: int,
                    step: StepPolicy, *, balance: str = "zigzag", batch: int = 1,
                    expert: int = 1, cluster: ClusterSpec | None = None) -> int:
    """The largest sequence length, a multiple of what ``check_seq_len`` needs for the
    layout, whose peak (``step.memory``, the tilings sized at that length against
    ``budget``) is at most ``budget`` bytes and, given the ``cluster``, whose offloads fit
    its host memory (``plan.check_host``'s rule); 0 when not even the shortest fits."""
    def fits(n: int) -> bool:
        if step.memory(model, n, dp, ring, ulysses, batch, expert, budget).total > budget:
            return False
        if cluster is None or step.forward_only:
            return True
        host = host_bytes(model, cluster, n, dp, ring, ulysses, batch, step.dtype_bytes,
                          step.checkpoint)
        return host <= step.mem_fraction * cluster.host_mem_bytes

    return largest_multiple(fits, seq_multiple(ulysses, ring, balance))


def max_seq_len(model: ModelConfig, budget: float, dp: int, ring: int, ulysses: int, *,
                balance: str = "zigzag", **kw) -> int:
    """The largest sequence length, a multiple of what ``check_seq_len`` needs for the
    layout, whose ``memory_split(...).total`` is at most ``budget`` bytes; 0 when not even
    the shortest fits. ``kw`` goes to ``memory_split`` (batch, dtype_bytes, policy, ...)."""
    return largest_multiple(
        lambda n: memory_split(model, n, dp, ring, ulysses, **kw).total <= budget,
        seq_multiple(ulysses, ring, balance))


def largest_multiple(fits, step: int) -> int:
    """The largest multiple ``n`` of ``step`` with ``fits(n)``, for a ``fits`` that holds up
    to some length and fails beyond it (memory grows with the length); 0 when ``fits(step)``
    fails: double, then bisect."""
    if not fits(step):
        return 0
    lo, hi = 1, 2
    while fits(hi * step):
        lo, hi = hi, 2 * hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid * step) else (lo, mid)
    return lo * step
