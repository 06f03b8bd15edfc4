"""Which global tokens this rank holds, on a mesh: shard, gather, global positions.

The arithmetic of who holds token t is ``usp.dims.tokens`` (``Ownership``, pure, no mesh);
a ``SequenceLayout`` applies it to this rank's coordinates and moves tensors by it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .comm import on_wire
from .dims.tokens import Ownership, position_tensor
from .mesh import SPMesh


class SequenceLayout:
    """Token ownership for one sequence length on one mesh.

    ``shard`` / ``gather`` convert between the global ``[..., L, ...]`` tensor and this
    rank's ``[..., L/P, ...]`` share (P = ring x ulysses); ``positions()`` gives the global
    position ids of this rank's tokens (not contiguous under zigzag), for RoPE. ``owner``
    is the mesh-free ``usp.dims.tokens.Ownership`` it applies.
    """

    def __init__(self, mesh: SPMesh, seq_len: int, balance: str = "zigzag"):
        self.mesh = mesh
        self.owner = Ownership(seq_len, mesh.ring, mesh.ulysses, balance)  # checks seq_len
        self.seq_len, self.balance = seq_len, balance
        self.local_len, self.segment_len = self.owner.local_len, self.owner.segment_len

    def segment_indices(self, ring_rank: int) -> torch.Tensor:
        """Global positions of ring rank ``ring_rank``'s segment, in segment order: [L/r]."""
        return position_tensor(self.owner.segment(ring_rank))

    def indices(self, ring_rank: int, ulysses_rank: int) -> torch.Tensor:
        """Global positions held by the rank at (ring_rank, ulysses_rank): [L/P]."""
        return position_tensor(self.owner.ranges(ring_rank, ulysses_rank))

    def positions(self, device: torch.device | str | None = None) -> torch.Tensor:
        """Global position ids of this rank's tokens: LongTensor [L/P]."""
        return self.indices(self.mesh.ring_rank, self.mesh.ulysses_rank).to(device)

    def shard(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """Global [..., L, ...] (sequence on ``dim``) -> this rank's [..., L/P, ...]."""
        if x.shape[dim] != self.seq_len:
            raise ValueError(
                f"layout.shard expects {self.seq_len} tokens on dim {dim}, got shape "
                f"{tuple(x.shape)}"
            )
        return x.index_select(dim, self.positions(x.device))

    def gather(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's [..., L/P, ...] -> the global [..., L, ...] on every rank of the SP group.

        Collective over the SP group; not differentiable (for evaluation and tests).
        """
        mesh = self.mesh
        if mesh.sp_size == 1:
            return x
        group = mesh.group("sp")
        wire = on_wire(x.contiguous(), group)  # a host copy when gloo must carry CUDA
        parts = [torch.empty_like(wire) for _ in range(mesh.sp_size)]
        dist.all_gather(parts, wire, group=group)  # sp_size x [..., L/P, ...]
        mesh.comm.record("sp", x.numel() * x.element_size() * (mesh.sp_size - 1))
        shape = list(x.shape)
        shape[dim] = self.seq_len
        full = x.new_empty(shape)  # [..., L, ...]
        for part, global_rank in zip(parts, dist.get_process_group_ranks(group)):
            _, i, j = (mesh.ranks == global_rank).nonzero()[0].tolist()
            full.index_copy_(dim, self.indices(i, j).to(x.device), part.to(x.device))
        return full
