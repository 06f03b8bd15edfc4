"""The global gradient norm and its clipping, over parameters sharded on several meshes.

``torch.nn.utils.clip_grad_norm_`` stacks every parameter's norm, which DTensors on two meshes
cannot do: with expert parallelism (``usp.models.expert_parallel``) the experts' weights live on
the expert mesh and the rest of the model on the dp x sp mesh, both over every rank. Then
each rank sums the squares of its own shards, one all-reduce over the ranks adds them up,
and every gradient is scaled by the same factor; on one mesh it is torch's own function.
The same sum of squares serves gradients in host memory (``trainer.state_offload``): torch's
function would reduce host tensors over NCCL, which takes device tensors only, so the one
all-reduce runs on a copy on the group's device."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def clip_grad_norm(parameters, max_norm: float, group=None, host: bool = False) -> torch.Tensor:
    """The 2-norm of all gradients of ``parameters`` (a plain scalar, fp64 when a parameter is,
    else fp32; the same on every rank of ``group``, default the world) after scaling them by
    ``min(1, max_norm / (norm + 1e-6))`` in place, as ``clip_grad_norm_`` does. Every gradient is a ``DTensor`` whose
    shards over ``group`` are disjoint (FSDP's, the experts'); a plain one, the same on
    every rank, counts once. ``host``: the gradients live in host memory (FSDP2's CPU
    offload); the norm is then this sum of squares over every shard, reduced on the group's
    device, on one mesh too."""
    parameters = list(parameters)
    meshes = {id(p.device_mesh) for p in parameters if isinstance(p, DTensor)}
    if len(meshes) <= 1 and not host:  # one mesh: torch's own, bit for bit as before
        norm = torch.nn.utils.clip_grad_norm_(parameters, max_norm)
        return norm.full_tensor() if isinstance(norm, DTensor) else norm
    grads = [p.grad for p in parameters if p.grad is not None]
    ranks = dist.get_world_size(group)
    local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
    device = local[0].device if local else _device(group)  # where the sum is taken
    # from the parameters, which every rank has alike (a rank may lack some gradients)
    dtype = torch.float64 if any(p.dtype == torch.float64 for p in parameters) else \
        torch.float32
    square = torch.zeros((), dtype=dtype, device=device)
    for g, t in zip(grads, local):
        part = t.to(dtype).pow(2).sum()
        square += part if isinstance(g, DTensor) else part / ranks
    reduced = square.to(_device(group))  # NCCL reduces device tensors only
    dist.all_reduce(reduced, group=group)
    total = reduced.to(device).sqrt()
    factor = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for t in local:
        t.mul_(factor.to(t.dtype))
    return total


def _device(group) -> torch.device:
    """Where ``group``'s backend takes tensors: the current GPU under NCCL, else the CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
