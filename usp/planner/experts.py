"""A mixture of experts as the planner prices it: which expert degrees a world can take, the
weights a rank gathers, a sparse MLP's activations, and the expert all-to-alls.

Expert degree ``N`` (``parallel.expert_degree``): the ``W = dp x ring x ulysses`` ranks form
``W/N`` expert groups of ``N`` consecutive ranks in the mesh's flattened [dp, ring, ulysses]
order; each rank of a group holds ``E/N`` of each sparse layer's ``E`` experts, FSDP-sharded
over the ``W/N`` ranks outside the group (the rest of the model over all ``W``). So the
sharded fp32 state of the experts is ``16 E_p / W`` a rank at every ``N`` (``E_p/N`` weights
over ``W/N`` ranks); what falls as ``1/N`` is what FSDP gathers: a sparse layer's experts in
the compute dtype and their unsharded gradients (``rank_mlp_params``), and the volume of the
experts' all-gathers and reduce-scatters.

Per sparse layer and sequence, a rank of ``n = L/(u r)`` tokens routes each token to ``k``
experts (``experts_per_token``): a dispatch all-to-all over its expert group sends each of the
``k n`` copies (``D`` wide, compute dtype) to the rank owning its expert and a combine
all-to-all returns them, ``(N-1)/N`` of them leaving the rank on average (uniform routing).
Backward runs both again, and each recompute of the MLP (activation checkpointing, or
``mlp_tiles > 1``, whose tiles are recomputed in backward) two more (``expert_a2a_count``).
Their time is exposed: the experts wait for their tokens. At ``N = 1`` nothing is exchanged.
"""

from __future__ import annotations

import math

from ..config import ModelConfig
from ..config.cluster import ClusterSpec
from ..dims.counts import divisors
from .cluster import group_span

FP32 = 4


def sparse_layers(model: ModelConfig) -> int:
    """How many layers' MLP is the experts (0 for a dense model)."""
    return sum(model.sparse(i) for i in range(model.n_layers))


def expert_params(model: ModelConfig) -> int:
    """The experts' weights over all sparse layers (gate, up, down of each of ``E``), the
    routers aside (they are sharded with the rest of the model)."""
    if model.n_experts is None:
        return 0
    return sparse_layers(model) * 3 * model.dim * model.expert_ffn_dim * model.n_experts


def expert_degrees(model: ModelConfig, world: int) -> list[int]:
    """The expert degrees a world of ``world`` ranks can take for ``model``: the divisors of
    both ``world`` and ``n_experts``; [1] for a dense model and for transformers' experts
    (``model.hf``), which expert parallelism does not spread (``usp.rules.check_expert_degree``,
    which refuses any other)."""
    if model.n_experts is None or model.hf is not None:
        return [1]
    return [n for n in divisors(world) if model.n_experts % n == 0]


def rank_mlp_params(model: ModelConfig, layer: int, degree: int) -> float:
    """The MLP weights of layer ``layer`` that FSDP gathers on a rank: a dense MLP's, or a
    sparse layer's router and the ``E/N`` experts the rank holds."""
    if not model.sparse(layer):
        return model.mlp_params(layer)
    D, E = model.dim, model.n_experts
    return D * E + 3 * D * model.expert_ffn_dim * E / degree


def mlp_memory(model: ModelConfig, layer: int, tokens: float, dtype_bytes: int,
               degree: int = 1) -> tuple[float, float, float]:
    """(saved, forward work, backward work) bytes of layer ``layer``'s MLP for one sequence
    of ``tokens`` tokens on a rank, in ``model.mlp_tiles`` tiles.

    Dense (``F = ffn_dim``): saved gate, SiLU, up and product ``4 a F`` a token; forward
    work a tile's four; backward two ``a F`` gradients beside the saved four, or a tiled
    tile's six. Sparse (``k`` experts of ``Fe`` a token, ``E`` experts): saved the router
    logits [n, E] and their fp32 softmax, the ``k`` routed copies [n k, D] entering the experts
    and leaving them, and the experts' intermediates [n k, Fe] x gate, SiLU, up, product;
    work as dense with ``k Fe`` for ``F``, the routed copies' gradients in backward, and the
    exchange's send and receive buffers ([n k, D] each, once per direction, ``N > 1``).
    Tiled (``mlp_tiles > 1``): nothing saved, a tile's all recomputed in backward."""
    a, tiled = dtype_bytes, model.mlp_tiles > 1
    t = math.ceil(tokens / model.mlp_tiles) if tiled else tokens  # tokens of a tile
    if not model.sparse(layer):
        F = model.ffn_dim
        saved = 0.0 if tiled else 4 * a * F * tokens
        return saved, 4 * a * F * t, (6 if tiled else 2) * a * F * t
    D, E, k, Fe = model.dim, model.n_experts, model.experts_per_token, model.expert_ffn_dim
    per_token = (a + FP32) * E + 2 * a * k * D + 4 * a * k * Fe
    buffers = 2 * a * k * D if degree > 1 else 0.0  # send + receive of one exchange
    saved = 0.0 if tiled else per_token * tokens
    fwd = (per_token + buffers) * t
    bwd = (2 * a * k * Fe + 2 * a * k * D + buffers) * t  # gradients beside the saved
    if tiled:
        bwd += per_token * t  # the tile recomputed: what it would have saved lives again
    return saved, fwd, bwd


def expert_a2a_count(recompute: bool, tiled: bool) -> int:
    """Expert all-to-alls per sparse layer per sequence: dispatch and combine in forward and
    in backward, and again for each recompute of the MLP (a checkpointed block, a tile)."""
    return 2 * (2 + int(recompute) + int(tiled))


def expert_a2a_bytes(model: ModelConfig, tokens: float, degree: int, dtype_bytes: int,
                     count: int) -> float:
    """Bytes a rank sends in its expert all-to-alls for one sequence of ``tokens`` tokens,
    all sparse layers, ``count`` all-to-alls a layer (``expert_a2a_count``):
    ``(N-1)/N k n D a`` each; 0 at ``N = 1``."""
    if model.n_experts is None or degree == 1:
        return 0.0
    one = (degree - 1) / degree * model.experts_per_token * tokens * model.dim * dtype_bytes
    return one * count * sparse_layers(model)


def expert_link(dp: int, ring: int, ulysses: int, ranks_per_node: int, degree: int,
                placement: str) -> str:
    """The link an expert group spans: "intra", "inter", or "-" (``N = 1``)."""
    if degree == 1:
        return "-"
    span = group_span(dp, ring, ulysses, ranks_per_node, "expert", placement, expert=degree)
    return "inter" if span.remote_peers else "intra"


def expert_a2a_s(cluster: ClusterSpec, model: ModelConfig, dp: int, ring: int, ulysses: int,
                 degree: int, tokens: float, dtype_bytes: int, count: int,
                 placement: str) -> float:
    """Seconds a rank waits on its expert all-to-alls for one sequence (all sparse layers,
    ``count`` a layer), exposed: ``k n D a / N`` bytes to each peer of its group, peers on the
    node over the intra-node link and peers on other nodes over the inter-node one, in
    parallel, on links shared by the node's concurrent senders, each message paying the
    link's latency; 0 at ``N = 1``."""
    if model.n_experts is None or degree == 1:
        return 0.0
    span = group_span(dp, ring, ulysses, cluster.ranks_per_node, "expert", placement,
                      expert=degree)
    chunk = model.experts_per_token * tokens * model.dim * dtype_bytes / degree
    local = span.local_peers * chunk / cluster.link_bw(False, span.intra_senders)
    remote = span.remote_peers * chunk / cluster.link_bw(True, span.inter_senders)
    lat = cluster.inter_latency_s if span.remote_peers else cluster.intra_latency_s
    return (lat + max(local, remote)) * count * sparse_layers(model)


def expert_sync(model: ModelConfig, degree: int) -> tuple[float, float]:
    """(weights FSDP syncs over all ``W`` ranks, weights a rank syncs over the ``W/N`` ranks
    outside its expert group): the model but the experts, and the ``E/N`` experts it holds."""
    ep = expert_params(model)
    return model.num_params() - ep, ep / degree
