"""The longest sequence one layout holds: ``memory.max_seq_len`` for any model, an ``auto``
``loss_chunk``/``mlp_tiles`` re-sized at every length tried (``tiles.size_tiles``)."""

from __future__ import annotations

from ..config import ModelConfig
from ..config.cluster import ClusterSpec
from ..rules import seq_multiple
from .memory import largest_multiple
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
