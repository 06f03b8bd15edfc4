"""Which global tokens this rank holds, on a mesh: shard, gather, global positions.

The arithmetic of who holds token t is ``usp.dims.tokens`` (``Ownership``, pure, no mesh);
a ``SequenceLayout`` applies it to this rank's coordinates and moves tensors by it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .comm import on_wire
from .dims.balance import per_document_segments
from .dims.tokens import Ownership, position_tensor, share
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


class DocumentLayout:
    """Per-document token ownership of one batch on one mesh (``balance="per_document"``).

    Every row has its own ring segments, decided from its documents' lengths
    (``usp.dims.balance.per_document_segments``: each ring rank holds L/r tokens and the
    same causal document-masked work); each segment is split contiguously across the
    ulysses group as under zigzag. ``positions()`` is [B, L/P] (one row of global
    position ids per batch row, for RoPE); ``shard``/``gather`` move [B, L, ...] tensors
    (batch on dim 0, sequence on dim 1) row by row. Every rank builds the same object from
    the same lengths, with no communication. The ring runs one pass per row when rows
    differ (``usp_attention``).
    """

    balance = "per_document"

    def __init__(self, mesh: SPMesh, doc_lens):
        self.mesh = mesh
        self.rows = tuple(tuple(int(n) for n in docs) for docs in doc_lens)
        lengths = sorted({sum(docs) for docs in self.rows})
        if len(lengths) != 1:
            raise ValueError(f"every row of a batch needs the same length, got row lengths "
                             f"{lengths}; pack rows to one seq_len")
        self.seq_len = lengths[0]
        Ownership(self.seq_len, mesh.ring, mesh.ulysses, "zigzag")  # 2 x ring x ulysses | L
        self.local_len = self.seq_len // mesh.sp_size
        self.segment_len = self.seq_len // mesh.ring
        self.segments = tuple(per_document_segments(docs, mesh.ring) for docs in self.rows)
        # the ring plans of this rank's rows, filled and reused by usp_attention (every
        # layer of a step calls it with the same layout): (rows, causal, window) -> (the
        # call's document ids [rows, L] or None, the plan built from them)
        self.plans: dict = {}

    @property
    def batch(self) -> int:
        return len(self.rows)

    def indices(self, ring_rank: int, ulysses_rank: int) -> torch.Tensor:
        """Global positions held by the rank at (ring_rank, ulysses_rank): [B, L/P]."""
        return torch.stack([position_tensor(share(seg[ring_rank], self.local_len, ulysses_rank))
                            for seg in self.segments])

    def positions(self, device: torch.device | str | None = None) -> torch.Tensor:
        """Global position ids of this rank's tokens, per row: LongTensor [B, L/P]."""
        return self.indices(self.mesh.ring_rank, self.mesh.ulysses_rank).to(device)

    def _index(self, idx: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        # [B, n] -> [B, n, *x.shape[2:]]: the same positions for every trailing entry
        return idx.reshape(*idx.shape, *(1,) * (x.dim() - 2)).expand(*idx.shape, *x.shape[2:])

    def _check(self, x: torch.Tensor, dim: int, length: int) -> None:
        if dim != 1 or x.dim() < 2 or x.shape[0] != self.batch or x.shape[1] != length:
            raise ValueError(f"a per_document layout moves [B={self.batch}, {length}, ...] "
                             f"tensors on dim 1, got shape {tuple(x.shape)} and dim {dim}")

    def shard(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """Global [B, L, ...] -> this rank's [B, L/P, ...], row by row."""
        self._check(x, dim, self.seq_len)
        return x.gather(1, self._index(self.positions(x.device), x))

    def gather(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's [B, L/P, ...] -> the global [B, L, ...] on every SP rank (collective
        over the SP group; not differentiable)."""
        self._check(x, dim, self.local_len)
        mesh = self.mesh
        if mesh.sp_size == 1:
            return x
        group = mesh.group("sp")
        wire = on_wire(x.contiguous(), group)
        parts = [torch.empty_like(wire) for _ in range(mesh.sp_size)]
        dist.all_gather(parts, wire, group=group)  # sp_size x [B, L/P, ...]
        mesh.comm.record("sp", x.numel() * x.element_size() * (mesh.sp_size - 1))
        full = x.new_empty(x.shape[0], self.seq_len, *x.shape[2:])  # [B, L, ...]
        for part, global_rank in zip(parts, dist.get_process_group_ranks(group)):
            _, i, j = (mesh.ranks == global_rank).nonzero()[0].tolist()
            full.scatter_(1, self._index(self.indices(i, j).to(x.device), x), part.to(x.device))
        return full
