"""Where the experts go under expert parallelism (``usp.models.expert_parallel``): the expert
mesh of an ``SPMesh`` and ``place_experts``, which spreads a model's experts over it."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from .expert_parallel import ExpertGroup
from .moe import MoeBlock

AXES = ("expert_fsdp", "expert")  # the expert mesh: [W/N, N]


def expert_mesh(mesh, degree: int) -> DeviceMesh:
    """The [W/N, N] DeviceMesh (``AXES``) of ``mesh`` (an ``SPMesh``) at expert degree N:
    its rows are the expert groups, N consecutive ranks of the [dp, ring, ulysses] order
    (each in rank order). Collective (every rank creates every group); kept with the mesh's other DeviceMeshes,
    so ``mesh.close()`` releases it."""
    key = f"expert_{degree}"
    if key not in mesh.flat_meshes:
        # each group in rank order, so that the mesh coordinate of a rank (which labels its
        # DTensor shard of the experts) is its rank in the group (which the exchange uses)
        rows = mesh.ranks.reshape(-1, degree).sort(dim=1).values  # [W/N, N]
        ranks = rows[rows[:, 0].argsort()]  # and the groups by their first rank
        device = mesh.device_mesh.device_type
        mesh.flat_meshes[key] = DeviceMesh(device, ranks, mesh_dim_names=AXES)
    return mesh.flat_meshes[key]


def place_experts(model, mesh, degree: int, mp_policy, offload_policy=None) -> int:
    """Spread the experts of every ``MoeBlock`` in ``model`` over expert groups of ``degree``
    ranks of ``mesh`` (an ``SPMesh``): each expert weight [E, ...] becomes a ``DTensor``
    split on the expert dim over the group (this rank's E/N experts; the others' storage
    dropped), FSDP-sharded over the W/N ranks outside the group (gradients scaled by 1/N);
    each block gets its ``ExpertGroup``. Before the blocks are FSDP-sharded (their own
    ``fully_shard`` skips these). ``offload_policy``: FSDP2's, as the rest of the model's
    (``usp.train.build.offload_policy``; None: no offload). Returns the blocks placed."""
    from torch.distributed.fsdp import OffloadPolicy, fully_shard

    em = expert_mesh(mesh, degree)
    for axis in AXES:  # the shard a DTensor names is the shard FSDP and the exchange use
        if em[axis].get_coordinate()[0] != em[axis].get_local_rank():
            raise RuntimeError(f"expert mesh {em.mesh.tolist()}: this rank's place on "
                               f"{axis} is not its rank in that group; usp lays the experts "
                               "out in rank order and cannot place them on this mesh")
    index = em["expert"].get_local_rank()
    blocks = [m for m in model.modules() if isinstance(m, MoeBlock)]
    for block in blocks:
        local = block.n_experts // degree
        for name, p in list(block.experts.named_parameters(recurse=False)):
            part = p.detach()[index * local:(index + 1) * local].clone()
            dt = DTensor.from_local(part, em["expert"], [Shard(0)], run_check=False)
            setattr(block.experts, name, torch.nn.Parameter(dt, requires_grad=p.requires_grad))
        fully_shard(block.experts, mesh=em["expert_fsdp"], mp_policy=mp_policy,
                    offload_policy=offload_policy or OffloadPolicy())
        block.experts.grad_scale = 1.0 / degree
        block.ep = ExpertGroup(em["expert"].get_group(), degree, index, block.n_experts,
                               mesh.comm)
    return len(blocks)
