"""Choose ``(dp, ring, ulysses)``: enumerate every layout of the world, drop the infeasible
ones with the rule that refused them, rank the rest by predicted step time per sequence
(layouts with more dp ranks run more sequences per step).

Every layout runs ``batch_per_dp_rank`` sequences per dp rank (a global batch of
``batch_per_dp_rank x dp``, as the trainer does), or with ``global_batch`` fixed, that many
split over dp. Memory is ``memory.memory_split`` (state, activations, attention, MLP and
logits terms under the model's ``loss_chunk``/``mlp_tiles`` and the checkpoint policy).

Rules, in order (each a ``ValueError`` text kept in ``Plan.dropped``):
degrees multiply to the world (``check_degrees``); a fixed global batch splits over dp; query
and KV heads split over ulysses (``check_heads``: every rank needs a query head; uneven
splits and KV replication are allowed and noted); the sequence splits over ``2 x ring x ulysses`` for zigzag
(``check_seq_len``); the predicted peak memory fits (the refusal names the largest term). A ulysses group that spans nodes stays
feasible but is noted, and pays for its all-to-all on the inter-node link in the model.
"""

from __future__ import annotations

from ..config import ModelConfig
from ..validate import check_degrees, check_placement, check_seq_len
from ..dims.counts import divisors
from ..dims.heads import check_heads, head_split
from ..config.cluster import GiB, ClusterSpec
from .cluster import group_span
from .cost import StepCost, choose_a2a_chunks, estimate
from .memory import CheckpointPolicy, MemorySplit, memory_split, size
from .ranking import Candidate, Dropped, Plan, group_dropped


FIXES = {  # what lowers each memory term, for the memory rule's message
    "state": "more ranks (FSDP shards the state over all of them)",
    "activations": "trainer.activation_checkpointing=true with checkpoint_every=1 "
                   "(or activation_offload on CUDA)",
    "attention": "a larger ring degree (shorter segments)",
    "mlp": "model.mlp_tiles > 1",
    "logits": "model.loss_chunk (e.g. 8192)",
}


def plan(
    model: ModelConfig,
    cluster: ClusterSpec,
    seq_len: int,
    nodes: int | None = None,
    world: int | None = None,
    balance: str = "zigzag",
    *,
    ulysses: int | None = None,
    ring: int | None = None,
    dp: int | None = None,
    batch_per_dp_rank: int = 1,
    global_batch: int | None = None,
    dtype_bytes: int = 2,
    causal: bool = True,
    fsdp: bool = True,
    placement: str = "ulysses_inner",
    act_checkpoint: bool = True,
    checkpoint: CheckpointPolicy | None = None,
    kernel: str = "torch",
    device: str = "cuda",
    mem_fraction: float = 0.9,
    a2a_chunks: int | str = 1,
) -> Plan:
    """Rank every ``dp x ring x ulysses = world`` layout for sequences of ``seq_len`` tokens
    on ``cluster`` (``nodes`` of it, or ``world`` ranks; default the whole cluster). Fix any
    degree by passing it; the others are searched.

    Batch: ``batch_per_dp_rank`` sequences on every dp rank (the trainer's
    ``data.batch_per_dp_rank``), or ``global_batch`` sequences split over dp (dp that do
    not divide it are dropped). ``checkpoint``: the activation checkpoint policy (default
    ``act_checkpoint`` on every block); ``kernel``/``device``: the attention kernel whose
    work buffers the memory counts (``memory.attention_buffers``). A layout fits when its
    peak memory (``memory.memory_split``) is at most ``mem_fraction`` of ``mem_bytes``.
    ``a2a_chunks``: pipeline stages of the ulysses all-to-alls for every layout, or
    ``"auto"``: each layout's ``best_a2a_chunks`` (its ``cost.a2a_chunks`` says which).
    Raises ``ValueError`` listing every reason when no layout is feasible.
    """
    check_placement(placement)
    if batch_per_dp_rank < 1 or (global_batch is not None and global_batch < 1):
        raise ValueError(f"batch_per_dp_rank={batch_per_dp_rank} and global_batch="
                         f"{global_batch} must be >= 1 (global_batch may be None)")
    policy = checkpoint or CheckpointPolicy(enabled=act_checkpoint)
    K = cluster.ranks_per_node
    if world is None:
        world = (nodes or cluster.nodes) * K
    elif nodes is not None and nodes * K != world:
        raise ValueError(f"world {world} != nodes {nodes} x ranks_per_node {K}; pass one of them")
    if world > K and world % K:
        raise ValueError(f"world {world} is not a whole number of {K}-GPU nodes")
    cluster = cluster.replace(nodes=max(1, world // K))
    budget = mem_fraction * cluster.mem_bytes
    mem_kw = dict(dtype_bytes=dtype_bytes, fsdp=fsdp, policy=policy, kernel=kernel,
                  device=device)

    fixed = {k: v for k, v in (("dp", dp), ("ring", ring), ("ulysses", ulysses)) if v is not None}
    for k, v in fixed.items():
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{k} degree must be a positive integer or None (auto), got {v!r}")
    if ulysses is not None and ring is not None:
        check_degrees(world, ulysses, ring, dp)  # raises, naming the degrees and a fix
    prod = (dp or 1) * (ring or 1) * (ulysses or 1)
    if world % prod:
        raise ValueError(
            f"fixed degrees {fixed} multiply to {prod}, which does not divide world {world}; "
            f"fix degrees whose product divides {world} or leave them unset"
        )

    candidates: list[Candidate] = []
    dropped: list[Dropped] = []
    for u in [ulysses] if ulysses is not None else divisors(world):
        for r in [ring] if ring is not None else divisors(world // u):
            d = world // (u * r)
            if dp is not None and d != dp:
                continue  # not a layout with the fixed dp
            rule = "degrees"  # the check running now, kept with a refusal
            try:
                check_degrees(world, u, r, d)
                rule = "batch"
                if global_batch is not None and global_batch % d:
                    raise ValueError(
                        f"global batch {global_batch} sequences does not split over dp {d}; "
                        f"use a batch that is a multiple of {d} or a larger sequence-parallel group"
                    )
                batch = batch_per_dp_rank if global_batch is None else global_batch // d
                rule = "heads"
                check_heads(model.n_heads, model.n_kv_heads, u)
                rule = "seq_len"
                check_seq_len(seq_len, u, r, balance)
                rule = "a2a_chunks"
                chunks = choose_a2a_chunks(
                    1 if u == 1 else a2a_chunks, cluster, seq_len, model.n_heads,
                    model.n_kv_heads, model.head_dim, u, r, dp=d, dtype_bytes=dtype_bytes,
                    causal=causal, balance=balance, placement=placement,
                    n_fwd=2 if policy.enabled else 1)
                rule = "memory"
                cost = estimate(
                    model, cluster, seq_len, d, r, u, global_batch=batch * d,
                    dtype_bytes=dtype_bytes, causal=causal, fsdp=fsdp, balance=balance,
                    placement=placement, act_checkpoint=policy.enabled, a2a_chunks=chunks,
                )
                mem = memory_split(model, seq_len, d, r, u, batch=batch, **mem_kw)
                _check_memory(mem, budget, mem_fraction, cluster, d)
            except ValueError as e:
                dropped.append(Dropped(d, r, u, str(e), rule))
                continue
            candidates.append(Candidate(d, r, u, cost, _notes(model, cluster, cost, placement),
                                        mem, batch))
    if not candidates:
        why = "; ".join(f"{rule} refused {len(ds)} (e.g. {ds[0].line()})"
                        for rule, ds in group_dropped(dropped).items())
        raise ValueError(f"no feasible layout for world {world}, seq_len {seq_len}: {why}")
    candidates.sort(key=lambda c: (c.seq_s, -c.ulysses))  # time per sequence
    per_rank = batch_per_dp_rank if global_batch is None else None
    return Plan(world, seq_len, cluster, model, candidates, dropped, per_rank, balance,
                global_batch, budget, mem_kw)


def _check_memory(mem: MemorySplit, budget: float, mem_fraction: float, cluster: ClusterSpec,
                  dp: int) -> None:
    """Refuse a layout whose peak exceeds ``budget``, naming the largest term and its fix."""
    if mem.total <= budget:
        return
    big = mem.dominant
    fixes = [FIXES[big]] + ([f"smaller dp than {dp}"] if dp > 1 else [])
    raise ValueError(
        f"needs {size(mem.total)} per rank at its peak ({mem.peak_at}) > {size(budget)} "
        f"({mem_fraction:.0%} of {cluster.mem_bytes / GiB:.0f} GiB); largest term {big} "
        f"{size(getattr(mem, big))}; try {', or '.join(fixes)}, more nodes "
        f"or a shorter sequence")


def _notes(model: ModelConfig, cluster: ClusterSpec, cost: StepCost, placement: str) -> list[str]:
    notes = []
    u, r = cost.ulysses, cost.ring
    split = head_split(model.n_heads, model.n_kv_heads, u)
    sent = sum(split.kv_counts)  # KV heads over all ulysses ranks, replicas included
    if sent > model.n_kv_heads:
        notes.append(f"KV heads replicated x{sent / model.n_kv_heads:g} (ulysses {u}, "
                     f"{model.n_kv_heads} KV heads)")
    if not split.even:
        notes.append(f"uneven heads {'/'.join(map(str, split.q_counts))}: busiest rank "
                     f"x{split.imbalance:.2f} the mean")
    if cost.a2a_link == "inter":
        span = group_span(cost.dp, r, u, cluster.ranks_per_node, "ulysses", placement)
        notes.append(f"WARNING ulysses spans {span.nodes} nodes: all-to-all on inter-node link")
    if r > 1:
        notes.append(f"ring {'across nodes' if cost.ring_link == 'inter' else 'in node'}")
        if cost.ring_exposed_s > 0:
            notes.append(f"ring comm {cost.ring_exposed_s / cost.ring_comm_s:.0%} exposed")
    return notes
