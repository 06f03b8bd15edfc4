"""``configs/parallel``: the sequence-parallel layout. The defaults are the ``usp_2x2`` option."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from .checks import at_least, one_of


@dataclass
class ParallelConfig:
    """The sequence-parallel layout. Degrees are ints or ``"auto"`` (chosen by the planner)."""

    ulysses_degree: Any = 2
    ring_degree: Any = 2
    dp_degree: Any = None  # None: world / (ulysses * ring)
    placement: str = "ulysses_inner"
    # zigzag | contiguous | per_document | auto: per_document when the data packs documents
    # under the document mask and usp's ring runs, else zigzag (usp.dims.balance.choose_balance)
    balance: str = "auto"
    kernel: str = "torch"
    ring_impl: str = "usp"
    ranks_per_node: Optional[int] = None  # CPU runs: pretend nodes of N ranks
    # pipeline stages of the ulysses all-to-alls (usp_attention's a2a_chunks): an int >= 1
    # (1: blocking) or "auto": 1 when each ulysses group stays inside a node, else the
    # planner's count (usp.planner.cost.best_a2a_chunks)
    a2a_chunks: Any = "auto"
    # a mixture of experts: the ranks that share one copy of each sparse layer's experts, each
    # holding n_experts / expert_degree of them (usp.models.expert_parallel); an int >= 1 that
    # divides dp x ring x ulysses and model.n_experts (1: every rank holds every expert), or
    # "auto": the planner picks
    expert_degree: Any = 1

    def __post_init__(self) -> None:
        from ..rules import BALANCE_SETTINGS, PLACEMENTS, RING_IMPLS, check_a2a_setting

        one_of("parallel.placement", self.placement, PLACEMENTS)
        one_of("parallel.balance", self.balance, BALANCE_SETTINGS)
        one_of("parallel.ring_impl", self.ring_impl, RING_IMPLS)
        check_a2a_setting(self.a2a_chunks, "parallel.a2a_chunks")
        if self.expert_degree != "auto":
            if isinstance(self.expert_degree, bool) or not isinstance(self.expert_degree, int):
                raise ValueError(f"parallel.expert_degree={self.expert_degree!r}: an int >= 1 "
                                 "or auto")
            at_least("parallel", 1, expert_degree=self.expert_degree)
        if self.ranks_per_node is not None:
            at_least("parallel", 1, ranks_per_node=self.ranks_per_node)
