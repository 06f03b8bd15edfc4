"""The router's load-balancing loss (Switch Transformer's, as transformers'
``load_balancing_loss_func`` forms it) from statistics that add up.

transformers pools every sparse layer and every token of the batch before it forms the loss:

    f_e = (sum over layers of the token-assignments to expert e) / (sum over layers of tokens)
    P_e = (sum over layers and tokens of softmax(router logits)[e]) / (same token total)
    loss = E * sum_e f_e * P_e

Each token counts k times in the assignments (its top-k), so sum_e f_e = k. Every term is a
sum, so a layer's ``RouterStats`` over any set of tokens (one sequence-parallel rank's, one
micro-batch's) add up to those of the union: ``pool`` the statistics of all layers, ranks
and micro-batches, then form ``balance_loss`` once. Only ``prob_sum`` carries a gradient;
``counts`` and ``tokens`` are integers, which is all a rank needs from the others
(``balance_loss_share``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch


@dataclass
class RouterStats:
    """One sparse layer's routing over the tokens at hand (or a sum of such).

    counts:   [E] int64, token-assignments per expert (a token counts once per top-k slot);
    prob_sum: [E] fp32, sum over the tokens of the softmax over all E router logits
              (differentiable: the loss's gradient reaches the router through it);
    tokens:   [] int64, the tokens routed.
    """

    counts: torch.Tensor
    prob_sum: torch.Tensor
    tokens: torch.Tensor

    def __add__(self, other: RouterStats) -> RouterStats:
        return RouterStats(self.counts + other.counts, self.prob_sum + other.prob_sum,
                           self.tokens + other.tokens)

    def detach(self) -> RouterStats:
        return RouterStats(self.counts, self.prob_sum.detach(), self.tokens)


def router_stats(probs: torch.Tensor, indices: torch.Tensor, n_experts: int) -> RouterStats:
    """``RouterStats`` of n tokens from probs [n, E] (softmax over all experts) and the
    chosen experts indices [n, k]."""
    counts = torch.bincount(indices.reshape(-1), minlength=n_experts)  # [n*k] -> [E] int64
    return RouterStats(counts, probs.float().sum(0),
                       torch.tensor(probs.shape[0], dtype=torch.int64, device=probs.device))


def pool(stats: Iterable[RouterStats]) -> RouterStats:
    """The sum of layers', ranks' or micro-batches' statistics (one ``RouterStats``)."""
    it = iter(stats)
    total = next(it, None)
    if total is None:
        raise ValueError("pool needs the RouterStats of at least one sparse layer; got none")
    for s in it:
        total = total + s
    return total


def balance_loss(stats: RouterStats | Iterable[RouterStats], n_experts: int) -> torch.Tensor:
    """transformers' ``load_balancing_loss_func`` (no attention mask) of the pooled statistics
    of every sparse layer: ``E * sum_e (counts_e / N) * (prob_sum_e / N)``, N = the tokens
    summed over layers. A scalar fp32 tensor."""
    s = stats if isinstance(stats, RouterStats) else pool(stats)
    n = s.tokens.to(torch.float32)
    return n_experts * torch.sum((s.counts.to(torch.float32) / n) * (s.prob_sum / n))


def balance_loss_share(local: RouterStats, pooled: RouterStats, n_experts: int) -> torch.Tensor:
    """This rank's share of ``balance_loss(pooled)``: ``E * sum_e counts_e / N**2 *
    local.prob_sum_e`` with ``counts`` and N from ``pooled`` (the statistics summed over every
    rank, their integers all-reduced; no gradient crosses ranks). The shares of all ranks add
    up to the loss, and each share's gradient is the loss's gradient with respect to this
    rank's router probabilities, because the loss is linear in ``prob_sum`` once the counts
    are fixed."""
    n = pooled.tokens.to(torch.float32)
    return n_experts * torch.sum(pooled.counts.to(torch.float32) / (n * n) * local.prob_sum)
