"""``ParallelDims``: the parallel layout as data, validated once.

After torchtitan's ``ParallelDims``: the degrees and how the mesh carries its exchanges,
checked in ``__post_init__`` with the rules of ``usp.rules`` (one message each, before
any process group); ``SPMesh.from_dims`` builds the mesh of it, the planner prices it,
nobody re-derives it.

Mesh axes by role: code that needs a group names what it is for, and ``axis(role)`` says
which mesh axis serves it:

- ``batch``: ranks that hold different sequences (``dp``), the data split;
- ``sequence``: ranks that share one sequence (``sp`` = ring x ulysses);
- ``loss``: ranks whose token counts and losses add up to the step's (``dp_sp``, all);
- ``fsdp``: ranks that shard the parameters (``dp_sp``, all).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..rules import check_a2a_setting, check_degrees, check_fragment_bytes, check_placement

ROLES = {"batch": "dp", "sequence": "sp", "loss": "dp_sp", "fsdp": "dp_sp"}


@dataclass(frozen=True)
class ParallelDims:
    """``dp x ring x ulysses`` ranks and how their exchanges travel.

    ``placement``: ``ulysses_inner`` (ulysses groups inside a node) or ``ring_inner``
    (``usp.dims.placement``). ``a2a_chunks``: pipeline stages of the ulysses all-to-alls,
    an int, or ``"auto"`` (``usp.dims.stages.default_a2a_chunks`` decides per call from
    the heads; ``usp-train`` passes the planner's priced count instead). ``fragment_bytes``:
    the largest fragment of one message to one peer, an int, ``"auto"`` (cut only where an
    axis's groups cross hosts over gloo, ``SPMesh.fragment_bytes_for``) or None (whole).
    """

    dp: int
    ring: int
    ulysses: int
    placement: str = "ulysses_inner"
    a2a_chunks: int | str = "auto"
    fragment_bytes: int | str | None = "auto"

    def __post_init__(self) -> None:
        for name in ("dp", "ring", "ulysses"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} degree must be a positive integer, got {value!r} "
                                 f"(dp {self.dp} x ring {self.ring} x ulysses {self.ulysses})")
        check_placement(self.placement)
        check_a2a_setting(self.a2a_chunks)
        check_fragment_bytes(self.fragment_bytes)

    @classmethod
    def for_world(cls, world: int, ulysses: int = 1, ring: int = 1, dp: int | None = None,
                  **kw) -> ParallelDims:
        """The dims of ``world`` ranks: ``dp`` derived when None (``rules.check_degrees``
        refuses degrees whose product is not ``world``); ``kw`` as the fields."""
        return cls(check_degrees(world, ulysses, ring, dp), ring, ulysses, **kw)

    @property
    def world(self) -> int:
        return self.dp * self.ring * self.ulysses

    @property
    def sp(self) -> int:
        """Ranks that share one sequence: ring x ulysses."""
        return self.ring * self.ulysses

    @staticmethod
    def axis(role: str) -> str:
        """The mesh axis that serves ``role`` (batch, sequence, loss, fsdp); see the module."""
        if role not in ROLES:
            raise ValueError(f"unknown mesh role {role!r}; choose one of {tuple(ROLES)}")
        return ROLES[role]
