"""What ``plan.plan`` is asked besides the model, the cluster and the sequence length, as
three frozen objects, each validated when it is made:

- ``Search``: the layouts it ranks (degrees fixed or searched, balance, placement, the
  ulysses all-to-all's pipeline stages);
- ``BatchSpec``: the sequences each layout runs per step;
- ``StepPolicy``: how every rank runs the step (dtype, causal mask, FSDP, activation
  checkpointing, attention kernel, device) and the share of device memory it may use.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config.cluster import ClusterSpec
from ..config import ModelConfig
from ..dims.counts import divisors
from ..rules import check_degrees, check_expert_degree, check_placement
from .experts import expert_degrees
from .memory import CheckpointPolicy, MemorySplit, memory_split
from .tiles import TileChoice, size_tiles


@dataclass(frozen=True)
class Search:
    """The layouts ``plan`` ranks: a degree given here is fixed, None is searched;
    ``balance`` and ``placement`` as ``parallel.*`` sets them; ``a2a_chunks``: pipeline
    stages of the ulysses all-to-alls for every layout, or ``"auto"``: each layout's
    ``cost.best_a2a_chunks`` (its ``cost.a2a_chunks`` says which); ``expert``: the expert
    degree of a mixture of experts (``experts``), None: every degree the world and the experts
    allow, ranked beside the layouts (a dense model takes 1)."""

    dp: int | None = None
    ring: int | None = None
    ulysses: int | None = None
    balance: str = "zigzag"
    placement: str = "ulysses_inner"
    a2a_chunks: int | str = 1
    expert: int | None = 1

    def __post_init__(self) -> None:
        check_placement(self.placement)
        if self.expert is not None and (not isinstance(self.expert, int) or self.expert < 1):
            raise ValueError(f"expert degree must be a positive integer or None (auto), "
                             f"got {self.expert!r}")
        for k, v in self.fixed.items():
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{k} degree must be a positive integer or None (auto), "
                                 f"got {v!r}")

    @property
    def fixed(self) -> dict[str, int]:
        """The fixed degrees by name, in the order dp, ring, ulysses."""
        pairs = (("dp", self.dp), ("ring", self.ring), ("ulysses", self.ulysses))
        return {k: v for k, v in pairs if v is not None}

    def check_world(self, world: int) -> None:
        """Refuse fixed degrees that no layout of ``world`` ranks can have."""
        if self.ulysses is not None and self.ring is not None:
            check_degrees(world, self.ulysses, self.ring, self.dp)  # names the degrees, a fix
        prod = (self.dp or 1) * (self.ring or 1) * (self.ulysses or 1)
        if world % prod:
            raise ValueError(
                f"fixed degrees {self.fixed} multiply to {prod}, which does not divide world "
                f"{world}; fix degrees whose product divides {world} or leave them unset"
            )

    def expert_degrees(self, model: ModelConfig, world: int) -> list[int]:
        """The expert degrees ``plan`` ranks for ``model`` on ``world`` ranks: the fixed one
        (refused naming the numbers when it does not divide both, ``check_expert_degree``), or
        every one the world and the experts allow."""
        if self.expert is not None:
            check_expert_degree(self.expert, world, model.n_experts, model.hf)
            return [self.expert]
        return expert_degrees(model, world)

    def layouts(self, world: int) -> list[tuple[int, int, int]]:
        """Every ``(dp, ring, ulysses)`` with the fixed degrees that ``plan`` judges, ulysses
        then ring ascending; dp is what is left of ``world`` (``check_degrees`` refuses a
        remainder)."""
        out = []
        for u in [self.ulysses] if self.ulysses is not None else divisors(world):
            for r in [self.ring] if self.ring is not None else divisors(world // u):
                d = world // (u * r)
                if self.dp is None or d == self.dp:
                    out.append((d, r, u))
        return out


@dataclass(frozen=True)
class BatchSpec:
    """The sequences each layout runs per step: ``per_dp_rank`` on every dp rank (the
    trainer's ``data.batch_per_dp_rank``, a global batch of ``per_dp_rank x dp``), or with
    ``global_batch`` set, that many split over dp (a dp that does not divide it is
    refused). ``step_sequences``: the sequences of one optimizer step
    (``trainer.global_batch_tokens / seq_len``), made of micro-batches of ``per_dp_rank x
    dp`` by accumulation: a dp whose micro-batch does not divide it is refused."""

    per_dp_rank: int = 1
    global_batch: int | None = None
    step_sequences: float | None = None

    def __post_init__(self) -> None:
        if self.per_dp_rank < 1 or (self.global_batch is not None and self.global_batch < 1):
            raise ValueError(f"batch_per_dp_rank={self.per_dp_rank} and global_batch="
                             f"{self.global_batch} must be >= 1 (global_batch may be None)")

    def for_dp(self, dp: int) -> int:
        """Sequences per dp rank with ``dp`` ranks; ValueError when the global batch does
        not split over them."""
        if self.step_sequences is not None and self.step_sequences % (self.per_dp_rank * dp):
            n = self.step_sequences
            raise ValueError(
                f"trainer.global_batch_tokens makes {n:g} sequences a step, not a whole number "
                f"of micro-batches of batch_per_dp_rank {self.per_dp_rank} x dp {dp}; a smaller "
                f"dp (a larger sequence-parallel group) or another global_batch_tokens")
        if self.global_batch is None:
            return self.per_dp_rank
        if self.global_batch % dp:
            raise ValueError(
                f"global batch {self.global_batch} sequences does not split over dp {dp}; "
                f"use a batch that is a multiple of {dp} or a larger sequence-parallel group"
            )
        return self.global_batch // dp

    def text(self) -> str:
        if self.global_batch is not None:
            return f"global batch {self.global_batch}"
        return f"batch {self.per_dp_rank} per dp rank"


@dataclass(frozen=True)
class StepPolicy:
    """How every rank runs the step: ``dtype_bytes`` of the compute dtype, a ``causal``
    mask, ``fsdp`` over all ranks (else replicated data parallel), the activation
    ``checkpoint`` policy, and the attention ``kernel`` on ``device`` whose work buffers the
    memory counts (``memory.attention_buffers``); a layout fits when its peak memory
    (``memory.memory_split``) is at most ``mem_fraction`` of the device's ``mem_bytes``.
    ``forward_only``: the step is one forward pass with no gradients and no optimizer state
    (usp-eval's scoring; ``fsdp=False``: the model whole on every rank, as usp-eval holds
    it); the memory is priced so, the time still as a training step."""

    dtype_bytes: int = 2
    causal: bool = True
    fsdp: bool = True
    checkpoint: CheckpointPolicy = CheckpointPolicy(enabled=True)
    kernel: str = "torch"
    device: str = "cuda"
    mem_fraction: float = 0.9
    forward_only: bool = False

    def budget(self, cluster: ClusterSpec) -> float:
        """Bytes per rank a layout may use on ``cluster``."""
        return self.mem_fraction * cluster.mem_bytes

    def memory_kw(self) -> dict:
        """``memory_split``'s keywords for this policy (and ``max_seq_len``'s)."""
        return dict(dtype_bytes=self.dtype_bytes, fsdp=self.fsdp, policy=self.checkpoint,
                    kernel=self.kernel, device=self.device, forward_only=self.forward_only)

    def memory(self, model: ModelConfig, seq_len: int, dp: int, ring: int, ulysses: int,
               batch: int, expert: int = 1, budget: float | None = None) -> MemorySplit:
        """``memory_split`` of ``batch`` sequences per dp rank under this policy (a mixture
        of experts at expert degree ``expert``); a model with ``auto`` ``loss_chunk`` or
        ``mlp_tiles`` is sized first against ``budget`` bytes (``tiles``)."""
        model = self.sized(model, seq_len, ring, ulysses, batch, expert, budget).model
        return memory_split(model, seq_len, dp, ring, ulysses, batch=batch,
                            expert_degree=expert, **self.memory_kw())

    def sized(self, model: ModelConfig, seq_len: int, ring: int, ulysses: int, batch: int,
              expert: int = 1, budget: float | None = None) -> TileChoice:
        """``tiles.size_tiles`` under this policy: ``model``'s ``auto`` ``loss_chunk`` and
        ``mlp_tiles`` sized for the layout and length against ``budget`` bytes a rank
        (needed only when one is ``auto``)."""
        if model.planned and budget is None:
            raise ValueError(f"model.{model.planned[0]}=auto is sized against a device "
                             "budget, and none was given here; set it to a number")
        return size_tiles(model, seq_len, ring, ulysses, budget or 0.0, batch=batch,
                          dtype_bytes=self.dtype_bytes, policy=self.checkpoint,
                          expert_degree=expert, forward_only=self.forward_only,
                          device=self.device)
