"""The global gradient norm and its clipping, over parameters sharded on several meshes.

``torch.nn.utils.clip_grad_norm_`` stacks every parameter's norm, which DTensors on two meshes
cannot do: with expert parallelism (``usp.models.expert_parallel``) the experts' weights live on
the expert mesh and the rest of the model on the dp x sp mesh, both over every rank. Each
rank sums the squares of its own shards, one all-reduce over the ranks adds them up, and
every gradient is scaled by the same factor."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def clip_grad_norm(parameters, max_norm: float, group=None) -> torch.Tensor:
    """The 2-norm of all gradients of ``parameters`` (a plain fp32 scalar, the same on every
    rank of ``group``, default the world) after scaling them by ``min(1, max_norm / (norm +
    1e-6))`` in place, as ``clip_grad_norm_`` does. Every gradient is a ``DTensor`` whose
    shards over ``group`` are disjoint (FSDP's, the experts'); a plain one, the same on
    every rank, counts once."""
    grads = [p.grad for p in parameters if p.grad is not None]
    ranks = dist.get_world_size(group)
    local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
    device = local[0].device if local else torch.device("cpu")
    square = torch.zeros((), dtype=torch.float32, device=device)
    for g, t in zip(grads, local):
        part = t.float().pow(2).sum()
        square += part if isinstance(g, DTensor) else part / ranks
    dist.all_reduce(square, group=group)
    total = square.sqrt()
    factor = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for t in local:
        t.mul_(factor.to(t.dtype))
    return total
