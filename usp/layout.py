"""Which global tokens each rank owns.

The sequence of length L is first cut into ring segments, then each segment is split
contiguously across the ulysses group (so the ulysses all-to-all reassembles exactly one
ring segment, in order).

- ``contiguous``: ring rank i owns tokens [i*L/r, (i+1)*L/r).
- ``zigzag``: the sequence is cut into 2r chunks of L/(2r); ring rank i owns chunks i and
  2r-1-i, so every ring rank has the same amount of causal work.

Example, L=16, ring=2, ulysses=2, zigzag: chunks of 4 -> ring 0 owns [0:4]+[12:16],
ring 1 owns [4:8]+[8:12]; (ring 0, ulysses 1) holds tokens 12..15.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .comm import on_wire
from .mesh import SPMesh
from .validate import check_seq_len


class SequenceLayout:
    """Token ownership for one sequence length on one mesh.

    ``shard`` / ``gather`` convert between the global ``[..., L, ...]`` tensor and this
    rank's ``[..., L/P, ...]`` piece (P = ring x ulysses); ``positions()`` gives the global
    position ids of this rank's tokens (not contiguous under zigzag), for RoPE.
    """

    def __init__(self, mesh: SPMesh, seq_len: int, balance: str = "zigzag"):
        check_seq_len(seq_len, mesh.ulysses, mesh.ring, balance)
        self.mesh, self.seq_len, self.balance = mesh, seq_len, balance
        self.local_len = seq_len // mesh.sp_size
        self.segment_len = seq_len // mesh.ring

    def segment_indices(self, ring_rank: int) -> torch.Tensor:
        """Global positions of ring rank ``ring_rank``'s segment, in segment order: [L/r]."""
        r, L = self.mesh.ring, self.seq_len
        if self.balance == "contiguous":
            return torch.arange(ring_rank * L // r, (ring_rank + 1) * L // r)
        c = L // (2 * r)
        first = torch.arange(ring_rank * c, (ring_rank + 1) * c)
        second = torch.arange((2 * r - 1 - ring_rank) * c, (2 * r - ring_rank) * c)
        return torch.cat([first, second])

    def indices(self, ring_rank: int, ulysses_rank: int) -> torch.Tensor:
        """Global positions held by the rank at (ring_rank, ulysses_rank): [L/P]."""
        n = self.local_len
        return self.segment_indices(ring_rank)[ulysses_rank * n : (ulysses_rank + 1) * n]

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
