"""Mixture-of-experts MLP blocks: Qwen3-MoE's sparse block and gpt-oss's MLP.

A block routes each token to its top-k experts and adds their outputs, weighted:

    x [..., D] -> [n, D]           tokens, flattened
    router: logits [n, E]          -> Routing: indices [n, k], weights [n, k], probs [n, E]
    dispatch: rows [n*k, D]        every (token, slot) pair, grouped by expert, ascending
    experts: rows [n*k, D]         expert e applied to its own contiguous group of rows
    combine: [n, D]                each row times its weight, added into its token
    -> [..., D], RouterStats       (``usp.models.moe_loss``: the load-balancing statistics)

Dropless: every token reaches all k of its experts (no capacity, no token dropped).
``dispatch`` and ``combine`` are the only places that move tokens between the token order
and the expert order; a block whose experts are spread over ranks (``ep``,
``usp.models.expert_parallel``) sends the rows in expert order to the ranks that hold their
experts and back by all-to-all, each rank holding a contiguous slice [E/N, ...] of the
experts' 3D weights.

The parameters have transformers' names and layouts (5.x keeps each block's experts fused
in 3D tensors), so a state dict maps with ``HF_RENAMES`` (ours -> transformers', relative to
the block; a name not listed is the same in both):

- ``Qwen3MoeBlock`` = ``Qwen3MoeSparseMoeBlock``: ``router.weight`` [E, D] (transformers'
  ``gate.weight``), ``experts.gate_up_proj`` [E, 2F, D] (gate rows then up rows),
  ``experts.down_proj`` [E, D, F];
- ``GptOssMoeBlock`` = ``GptOssMLP``: ``router.weight`` [E, D], ``router.bias`` [E],
  ``experts.gate_up_proj`` [E, D, 2F] (gate at even columns, up at odd: interleaved),
  ``experts.gate_up_proj_bias`` [E, 2F], ``experts.down_proj`` [E, F, D],
  ``experts.down_proj_bias`` [E, D].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from .expert_parallel import ExpertGroup, local_tensor, scale_grad
from .moe_loss import RouterStats, router_stats


@dataclass
class Routing:
    """Where n tokens go: ``indices`` [n, k] int64 (their experts), ``weights`` [n, k] in
    the logits' dtype (each expert output's weight), ``probs`` [n, E] (softmax over all
    experts, for the load-balancing statistics)."""

    indices: torch.Tensor
    weights: torch.Tensor
    probs: torch.Tensor


def softmax_then_topk(logits: torch.Tensor, k: int, renormalise: bool) -> Routing:
    """Qwen3-MoE: softmax over all experts in fp32, top-k of it, renormalised over the k
    when ``renormalise`` (``norm_topk_prob``), weights cast back to the logits' dtype."""
    probs = F.softmax(logits, dim=-1, dtype=torch.float32)  # [n, E] fp32
    top, indices = torch.topk(probs, k, dim=-1)  # [n, k]
    if renormalise:
        top = top / top.sum(dim=-1, keepdim=True)
    return Routing(indices, top.to(logits.dtype), probs)


def topk_then_softmax(logits: torch.Tensor, k: int) -> Routing:
    """gpt-oss: top-k of the logits, softmax over those k in the logits' dtype. ``probs``
    (for the loss only) is the softmax over all experts, as transformers' load-balancing loss
    takes it, here in fp32."""
    top, indices = torch.topk(logits, k, dim=-1)  # [n, k]
    weights = F.softmax(top, dim=-1, dtype=top.dtype)
    return Routing(indices, weights, F.softmax(logits, dim=-1, dtype=torch.float32))


class Router(nn.Module):
    """x [n, D] -> logits [n, E] = x W^T (+ b)."""

    def __init__(self, dim: int, n_experts: int, bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_experts, dim))
        self.bias = nn.Parameter(torch.empty(n_experts)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


@dataclass
class Dispatch:
    """The expert order of n tokens' n*k assignments: ``order`` [n*k] int64 (the flat
    assignment ``token * k + slot`` of each row, grouped by expert, ascending), ``sizes``
    (rows per expert, E ints on the host), ``k``."""

    order: torch.Tensor
    sizes: list[int]
    k: int

    @property
    def token(self) -> torch.Tensor:
        return self.order // self.k  # [n*k]: the token each row came from


def dispatch(x: torch.Tensor, indices: torch.Tensor, n_experts: int
             ) -> tuple[torch.Tensor, Dispatch]:
    """x [n, D], indices [n, k] -> rows [n*k, D] grouped by expert (expert 0's first), and
    the ``Dispatch`` that ``combine`` undoes. Within an expert, rows keep the token order."""
    flat = indices.reshape(-1)  # [n, k] -> [n*k]
    order = torch.argsort(flat, stable=True)  # [n*k], grouped by expert
    sizes = torch.bincount(flat, minlength=n_experts).tolist()  # one host sync per block
    plan = Dispatch(order, sizes, indices.shape[1])
    return x[plan.token], plan  # [n, D] -> [n*k, D]


def combine(rows: torch.Tensor, weights: torch.Tensor, plan: Dispatch, n: int) -> torch.Tensor:
    """rows [n*k, D] in expert order, weights [n, k] -> [n, D]: each row times its weight,
    added into its token (in expert order, as transformers adds them)."""
    w = weights.reshape(-1)[plan.order]  # [n, k] -> [n*k], in expert order
    out = rows.new_zeros(n, rows.shape[-1])
    return out.index_add_(0, plan.token, rows * w[:, None])


class Experts(nn.Module):
    """E experts in fused [E, ...] weights (or this rank's E/N of them, ``local_tensor``):
    ``forward(rows, sizes)`` runs rows [m, D] grouped by local expert (``sizes[e]`` rows for
    expert e) -> [m, D], each group through its expert (``expert(e, rows_e)``, which a
    subclass defines). An expert with no rows runs too, on none: every weight is in the
    graph on every rank, so each gets a gradient (zero) and FSDP reduces the same tensors
    everywhere, and a rank that received no rows still runs the backward exchanges. A module
    call, so that FSDP gathers the weights of experts sharded apart
    (``usp.models.expert_parallel``)."""

    grad_scale: float = 1.0  # the weights' gradients times this (expert parallelism: 1/N)

    def forward(self, rows: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        return torch.cat([self.expert(e, group) for e, group in enumerate(rows.split(sizes))])

    def local(self, name: str) -> torch.Tensor:
        """Weight ``name``'s local experts [E or E/N, ...] (``local_tensor``), its gradient
        scaled by ``grad_scale``."""
        w = local_tensor(getattr(self, name))
        return w if self.grad_scale == 1.0 else scale_grad(w, self.grad_scale)

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class SwiGLUExperts(Experts):
    """E SwiGLU experts, Qwen3-MoE's layout: ``gate_up_proj`` [E, 2F, D] (gate rows [0, F),
    up rows [F, 2F)), ``down_proj`` [E, D, F]; expert e: x -> down(silu(gate x) * up x)."""

    def __init__(self, dim: int, n_experts: int, ffn_dim: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(n_experts, 2 * ffn_dim, dim))
        self.down_proj = nn.Parameter(torch.empty(n_experts, dim, ffn_dim))

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Local expert e (of this rank's: ``local_tensor``) on x [m, D]."""
        gate_up, down = self.local("gate_up_proj")[e], self.local("down_proj")[e]
        gate, up = F.linear(x, gate_up).chunk(2, dim=-1)  # [m, D] -> 2 x [m, F]
        return F.linear(F.silu(gate) * up, down)  # [m, F] -> [m, D]


class ClampedGLUExperts(Experts):
    """E experts of gpt-oss, with biases, its layout: ``gate_up_proj`` [E, D, 2F] (x @ W;
    gate at even columns, up at odd), ``gate_up_proj_bias`` [E, 2F], ``down_proj`` [E, F, D],
    ``down_proj_bias`` [E, D]. Expert e: gate clamped above at ``limit``, up to
    [-limit, limit], then ``(up + 1) * gate * sigmoid(alpha * gate)`` and the down projection."""

    def __init__(self, dim: int, n_experts: int, ffn_dim: int, alpha: float, limit: float):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(n_experts, dim, 2 * ffn_dim))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(n_experts, 2 * ffn_dim))
        self.down_proj = nn.Parameter(torch.empty(n_experts, ffn_dim, dim))
        self.down_proj_bias = nn.Parameter(torch.empty(n_experts, dim))
        self.alpha, self.limit = alpha, limit

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Local expert e (of this rank's: ``local_tensor``) on x [m, D]."""
        w = {k: self.local(k)[e] for k in
             ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")}
        gate_up = x @ w["gate_up_proj"] + w["gate_up_proj_bias"]  # [m, D] -> [m, 2F]
        gate = gate_up[:, 0::2].clamp(max=self.limit)  # [m, F]
        up = gate_up[:, 1::2].clamp(min=-self.limit, max=self.limit)  # [m, F]
        h = (up + 1) * (gate * torch.sigmoid(gate * self.alpha))
        return h @ w["down_proj"] + w["down_proj_bias"]  # [m, F] -> [m, D]


class MoeBlock(nn.Module):
    """x [..., D] -> (y [..., D], ``RouterStats``): route, dispatch, experts, combine.
    Subclasses set ``router``, ``experts``, ``n_experts``, ``top_k`` and ``route``. ``ep``:
    None (this rank holds every expert) or the ``ExpertGroup`` its experts are spread over
    (``usp.models.expert_placement.place_experts``)."""

    router: Router
    experts: Experts
    n_experts: int
    top_k: int
    ep: ExpertGroup | None = None

    def route(self, logits: torch.Tensor) -> Routing:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, RouterStats]:
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # [..., D] -> [n, D]
        routing = self.route(self.router(x))  # logits [n, E]
        rows, plan = dispatch(x, routing.indices, self.n_experts)  # [n*k, D], expert order
        if self.ep is None:
            rows = self.experts(rows, plan.sizes)  # [n*k, D]
        else:  # to the ranks that hold the experts and back
            rows = self.ep.run(self.experts, rows, plan.sizes)
        y = combine(rows, routing.weights, plan, x.shape[0])  # [n, D]
        stats = router_stats(routing.probs, routing.indices, self.n_experts)
        return y.reshape(shape), stats


class Qwen3MoeBlock(MoeBlock):
    """Qwen3-MoE's sparse block (transformers' ``Qwen3MoeSparseMoeBlock``): a router without
    bias, softmax then top-k (renormalised when ``norm_topk_prob``), SwiGLU experts of width
    ``ffn_dim`` (``moe_intermediate_size``)."""

    HF_RENAMES = {"router.weight": "gate.weight"}

    def __init__(self, dim: int, n_experts: int, top_k: int, ffn_dim: int,
                 norm_topk_prob: bool, init_std: float = 0.02):
        super().__init__()
        self.n_experts, self.top_k, self.norm_topk_prob = n_experts, top_k, norm_topk_prob
        self.router = Router(dim, n_experts, bias=False)
        self.experts = SwiGLUExperts(dim, n_experts, ffn_dim)
        with torch.no_grad():  # as transformers initialises them
            for p in self.parameters():
                p.normal_(0.0, init_std)

    def route(self, logits: torch.Tensor) -> Routing:
        return softmax_then_topk(logits, self.top_k, self.norm_topk_prob)


class GptOssMoeBlock(MoeBlock):
    """gpt-oss's MLP (transformers' ``GptOssMLP``, without its second output, the routing
    weights): a router with bias, top-k of the logits then softmax over the k, clamped gated
    experts with biases (``alpha`` = ``swiglu_alpha``, ``limit`` = ``swiglu_limit``)."""

    HF_RENAMES: dict[str, str] = {}

    def __init__(self, dim: int, n_experts: int, top_k: int, ffn_dim: int,
                 alpha: float = 1.702, limit: float = 7.0, init_std: float = 0.02):
        super().__init__()
        self.n_experts, self.top_k = n_experts, top_k
        self.router = Router(dim, n_experts, bias=True)
        self.experts = ClampedGLUExperts(dim, n_experts, ffn_dim, alpha, limit)
        with torch.no_grad():  # as transformers initialises them: expert biases zero
            for name, p in self.named_parameters():
                if name.endswith("_proj_bias"):
                    p.zero_()
                else:
                    p.normal_(0.0, init_std)

    def route(self, logits: torch.Tensor) -> Routing:
        return topk_then_softmax(logits, self.top_k)
