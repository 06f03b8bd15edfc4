"""The trainer's side of a mixture of experts' router loss (``usp.models.router_loss``).

Each micro-batch's forward records its routing (``open``); before its backward, ``settle``
pools the statistics over the ranks that share the batch (``model.router_balance_over=sp``:
the ranks of one sequence group, so the loss is transformers' on the batch one dp rank
trains; ``dp``: every rank, one loss of the global batch) and fixes the router loss's
gradient at ``model.router_aux_loss_coef`` times it, scaled as the LM loss is for FSDP's
mean over all W ranks (x W / dp, or x W) and divided over the step's micro-batches. The
step's metrics: ``aux_loss`` (the pooled loss, the mean over micro-batches and dp ranks;
the logged ``loss`` and ``val_loss`` are the LM loss alone), ``expert_load`` (the busiest
expert's token-assignments over the mean, the largest over the sparse layers) and, with
expert parallelism, ``expert_a2a_mb`` and ``expert_comm_s``: the MiB this rank sent to other
ranks in the expert exchanges (out and back, forward and backward, recomputation included)
and the seconds it was blocked in them (``CommStats`` axis ``expert``; the largest over the
ranks).

With several micro-batches a step, each micro-batch's statistics make their own loss and the
step's is their mean: the counts of later micro-batches are not known when an earlier one's
backward runs. With one micro-batch a step (the long-context case) it is transformers' loss
on the same batch.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..models.expert_parallel import AXIS
from ..models.sparse_mlp import attach_ledger

EXPERT_AXES = (AXIS,)  # CommStats' axes of the expert exchanges (not attention's)


class RouterBalance:
    """The router loss of ``model`` (built-in, a mixture of experts; nothing otherwise) on
    ``mesh`` (an ``SPMesh``) as ``mc`` (the model config) says."""

    def __init__(self, model, mc, mesh):
        self.ledger = attach_ledger(model)
        self.comm = mesh.comm
        self.spread = any(getattr(m, "ep", None) is not None for m in model.modules())
        self.exchanged = (0, 0.0)  # the expert axis's bytes and seconds before this step
        self.weight = float(mc.router_aux_loss_coef or 0.0)
        world, dp = mesh.sp_size * mesh.dp, mesh.dp
        if mc.router_balance_over == "dp":
            self.group, self.scale = mesh.group("dp_sp"), float(world)
        else:
            self.group, self.scale = mesh.group("sp"), float(world // dp)
        self.dp_group, self.dp = mesh.group("dp"), dp
        self.losses: list[float] = []
        self.loads: list[float] = []

    def open(self, first: bool) -> None:
        """The next forward is a training micro-batch's (``first``: the step's first):
        record its routing."""
        if self.ledger is not None:
            self.ledger.open()
        if first:
            self.exchanged = (self.comm.bytes[AXIS], self.comm.seconds[AXIS])

    def settle(self, micro_batches: int) -> None:
        """Collective (the pooling group): after a micro-batch's forward, before its
        backward."""
        if self.ledger is None:
            return
        self.ledger.settle(self.weight * self.scale / micro_batches, self.group)
        self.losses.append(self.ledger.loss())
        self.loads.append(self.ledger.busiest())

    def metrics(self, device) -> dict:
        """Collective over dp (with expert parallelism, over every rank): the step's
        ``aux_loss`` and ``expert_load`` (means over its micro-batches and the dp ranks) and
        the exchanges' figures; {} for a dense model."""
        if self.ledger is None:
            return {}
        both = torch.tensor([sum(self.losses) / len(self.losses),
                             sum(self.loads) / len(self.loads)], dtype=torch.float64,
                            device=device)
        self.losses, self.loads = [], []
        if self.dp > 1:
            dist.all_reduce(both, group=self.dp_group)
            both /= self.dp
        out = {"aux_loss": both[0].item(), "expert_load": both[1].item()}
        sent = self.comm.bytes[AXIS] - self.exchanged[0]
        if self.spread:  # expert parallelism (every rank alike): its exchanges, busiest rank
            most = torch.tensor([sent / 2**20, self.comm.seconds[AXIS] - self.exchanged[1]],
                                dtype=torch.float64, device=device)
            dist.all_reduce(most, op=dist.ReduceOp.MAX)
            out.update(expert_a2a_mb=most[0].item(), expert_comm_s=most[1].item())
        return out
