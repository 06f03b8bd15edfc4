"""The router's load-balancing loss in training, its statistics pooled over ranks first.

transformers forms a mixture of experts' auxiliary loss once per batch from every sparse
layer's routing (``usp.models.moe_loss``): ``E * sum_e f_e P_e``, ``f_e`` the share of
token-assignments to expert e and ``P_e`` the mean router probability of e, both pooled over
the layers and every token. Under sequence parallelism a batch's tokens are spread over the
ranks, so no rank can form it alone; but the loss is linear in each layer's ``prob_sum`` once
the counts are known, and the counts carry no gradient. So:

1. in forward, each sparse layer hands its ``RouterStats`` to the model's ``RouterLedger``
   (``record``; the MLP's output passes through ``inject``, which changes nothing);
2. after the forward and before backward, ``settle`` all-reduces every layer's counts,
   tokens and (for the logged value) probability sums over the ranks that share the
   batch — one collective of [layers, 2E + 1] numbers — and fixes the gradient each
   layer's ``prob_sum`` gets: ``weight * E * F_e / N**2`` (F: the pooled counts, N: the
   pooled token-layers);
3. in backward, ``inject`` hands that gradient to the layer's ``prob_sum``, from where it
   reaches the router and everything before it, as the gradient of ``weight x loss``.

A recomputation in backward (activation checkpointing, MLP tiles) records nothing once the
ledger is settled: the statistics are those of the forward.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .moe_loss import RouterStats


class RouterLedger:
    """The router statistics of one forward pass of a model's sparse layers.

    States: closed (forward passes record nothing: validation, evaluation), ``open()`` (the
    next forward records), ``settle(...)`` (pooled, gradients fixed; records ignored until
    the next ``open``)."""

    def __init__(self, n_experts: int):
        self.n_experts = n_experts
        self.recording = False
        self.stats: dict[int, RouterStats] = {}  # layer -> this rank's, summed over tiles
        self.grad: torch.Tensor | None = None  # [E]: each prob_sum's gradient, once settled
        self.pooled: torch.Tensor | None = None  # [layers, 2E + 1] fp64 over the group

    def open(self) -> None:
        """The next forward pass records (a micro-batch of training)."""
        self.recording, self.stats, self.grad, self.pooled = True, {}, None, None

    def record(self, layer: int, stats: RouterStats) -> None:
        if self.recording:
            s = stats.detach()
            self.stats[layer] = s if layer not in self.stats else self.stats[layer] + s

    def settle(self, weight: float, group=None) -> None:
        """Collective over ``group`` (the ranks whose tokens make one batch): pool every
        layer's statistics and fix the gradient of each layer's ``prob_sum``:
        ``weight * E * F_e / N**2``. Recording stops."""
        self.recording = False
        e, layers = self.n_experts, sorted(self.stats)
        if not layers:  # no sparse layer ran (cannot happen in a mixture of experts)
            raise RuntimeError("RouterLedger.settle: no sparse layer recorded its routing")
        device = self.stats[layers[0]].counts.device
        rows = torch.stack([torch.cat([self.stats[k].counts.double(),
                                       self.stats[k].prob_sum.double(),
                                       self.stats[k].tokens.double().reshape(1)])
                            for k in layers]).to(device)  # [layers, 2E + 1]
        dist.all_reduce(rows, group=group)
        self.pooled = rows
        counts, tokens = rows[:, :e].sum(0), rows[:, 2 * e].sum()
        self.grad = (weight * e * counts / tokens ** 2).float()

    def loss(self) -> float:
        """The pooled balance loss of the settled pass (transformers' value on the batch)."""
        e, rows = self.n_experts, self.pooled
        tokens = rows[:, 2 * e].sum()
        return float(e * ((rows[:, :e].sum(0) / tokens) * (rows[:, e:2 * e].sum(0) / tokens))
                     .sum())

    def busiest(self) -> float:
        """The busiest expert's token-assignments over the mean, the largest over the sparse
        layers of the settled pass (1: every layer perfectly balanced)."""
        counts = self.pooled[:, :self.n_experts]
        return float((counts.max(1).values / counts.mean(1).clamp(min=1e-12)).max())


class _Inject(torch.autograd.Function):
    """y itself; in backward, the ledger's settled gradient to ``prob_sum``."""

    @staticmethod
    def forward(ctx, y, prob_sum, ledger):
        ctx.ledger = ledger
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad):
        g = ctx.ledger.grad
        if g is None:
            raise RuntimeError("backward through a sparse layer before RouterLedger.settle: "
                               "the router loss's gradient is not known yet")
        return grad, g, None


def inject(y: torch.Tensor, stats: RouterStats, ledger: RouterLedger, layer: int
           ) -> torch.Tensor:
    """A sparse MLP's output ``y`` with the router loss's gradient wired to ``stats.prob_sum``
    (recorded in ``ledger`` as layer ``layer``)."""
    ledger.record(layer, stats)
    if not torch.is_grad_enabled() or not stats.prob_sum.requires_grad:
        return y
    return _Inject.apply(y, stats.prob_sum, ledger)
