"""Choose ``(dp, ring, ulysses)``: enumerate every layout of the world, drop the infeasible
ones with the rule that refused them, rank the rest by predicted step time per sequence
(layouts with more dp ranks run more sequences per step).

What it is asked besides the model, the cluster and the length is three objects
(``options``): which layouts (``Search``), the batch each runs (``BatchSpec``: per dp rank,
as the trainer does, or a fixed global batch split over dp), how every rank runs the step
(``StepPolicy``). Memory is ``memory.memory_split`` (state, activations, attention, MLP and
logits terms under the model's ``loss_chunk``/``mlp_tiles`` and the checkpoint policy; an
``auto`` one sized for each layout, ``tiles.size_tiles``, kept in ``Candidate.model``).

Rules, in order (each a ``ValueError`` text kept in ``Plan.dropped``):
degrees multiply to the world (``check_degrees``); a fixed global batch splits over dp; query
and KV heads split over ulysses (``check_heads``: every rank needs a query head; uneven
splits and KV replication are allowed and noted); the sequence splits over ``2 x ring x ulysses`` for zigzag
(``check_seq_len``); the predicted peak memory fits (the refusal names the largest term); with
an offload, the node's host memory holds what its ranks offload (``check_host``,
rule ``host_memory``). A ulysses group that spans nodes stays
feasible but is noted, and pays for its all-to-all on the inter-node link in the model.
"""

from __future__ import annotations

from ..config import ModelConfig
from ..rules import check_degrees, check_seq_len
from ..dims.heads import check_heads, head_split
from ..config.cluster import GiB, ClusterSpec
from .cluster import group_span
from .cost import StepCost, choose_a2a_chunks, estimate
from .memory import MemorySplit, size
from .offload import host_bytes
from .options import BatchSpec, Search, StepPolicy
from .ranking import Candidate, Dropped, Plan, group_dropped


FIXES = {  # what lowers each memory term, for the memory rule's message
    "state": "more ranks (FSDP shards the state over all of them)",
    "activations": "trainer.activation_checkpointing=true with checkpoint_every=1 "
                   "(or activation_offload on CUDA)",
    "attention": "a larger ring degree (shorter segments)",
    "mlp": "model.mlp_tiles > 1",
    "logits": "model.loss_chunk (e.g. 8192)",
}


def plan(model: ModelConfig, cluster: ClusterSpec, seq_len: int, *, world: int | None = None,
         search: Search = Search(), batch: BatchSpec = BatchSpec(),
         step: StepPolicy = StepPolicy()) -> Plan:
    """Rank every ``dp x ring x ulysses = world`` layout that ``search`` allows for sequences
    of ``seq_len`` tokens on ``cluster`` (``world`` ranks of it, default all of its nodes),
    each layout running ``batch`` with every rank under ``step``. Raises ``ValueError``
    listing every reason when no layout is feasible."""
    cluster, world = _sized(cluster, world)
    search.check_world(world)
    experts = search.expert_degrees(model, world)  # a fixed one that cannot be is refused
    judged = [_judge(model, cluster, seq_len, world, layout, search, batch, step, n)
              for layout in search.layouts(world) for n in experts]
    candidates = [c for c in judged if isinstance(c, Candidate)]
    dropped = [d for d in judged if isinstance(d, Dropped)]
    if not candidates:
        why = "; ".join(f"{rule} refused {len(ds)} (e.g. {ds[0].line()})"
                        for rule, ds in group_dropped(dropped).items())
        raise ValueError(f"no feasible layout for world {world}, seq_len {seq_len}: {why}")
    candidates.sort(key=lambda c: (c.seq_s, -c.ulysses, c.expert))  # time per sequence
    return Plan(world, seq_len, cluster, model, candidates, dropped, search, batch, step)


def _sized(cluster: ClusterSpec, world: int | None) -> tuple[ClusterSpec, int]:
    """(the cluster cut to the nodes ``world`` ranks fill, ``world``; default every rank)."""
    K = cluster.ranks_per_node
    if world is None:
        world = cluster.nodes * K
    if world > K and world % K:
        raise ValueError(f"world {world} is not a whole number of {K}-GPU nodes")
    return cluster.replace(nodes=max(1, world // K)), world


def _judge(model: ModelConfig, cluster: ClusterSpec, seq_len: int, world: int,
           layout: tuple[int, int, int], search: Search, batch: BatchSpec,
           step: StepPolicy, expert: int = 1) -> Candidate | Dropped:
    """One ``(dp, ring, ulysses)`` at expert degree ``expert`` through the rules in order
    (``ranking.RULES``): priced as a ``Candidate``, or ``Dropped`` with the first rule that
    refused it and its message."""
    d, r, u = layout
    rule = "degrees"  # the check running now, kept with a refusal
    try:
        check_degrees(world, u, r, d)
        rule = "batch"
        b = batch.for_dp(d)
        rule = "heads"
        check_heads(model.n_heads, model.n_kv_heads, u)
        rule = "seq_len"
        check_seq_len(seq_len, u, r, search.balance)
        rule = "a2a_chunks"
        ckpt = step.checkpoint.enabled
        chunks = choose_a2a_chunks(
            1 if u == 1 else search.a2a_chunks, cluster, seq_len, model.n_heads,
            model.n_kv_heads, model.head_dim, u, r, dp=d, dtype_bytes=step.dtype_bytes,
            causal=step.causal, balance=search.balance, placement=search.placement,
            n_fwd=2 if ckpt else 1)
        rule = "memory"
        budget = step.budget(cluster)
        model = step.sized(model, seq_len, r, u, b, expert, budget).model  # auto tilings
        cost = estimate(
            model, cluster, seq_len, d, r, u, global_batch=b * d, dtype_bytes=step.dtype_bytes,
            causal=step.causal, fsdp=step.fsdp, balance=search.balance,
            placement=search.placement, act_checkpoint=ckpt, a2a_chunks=chunks,
            expert_degree=expert, policy=step.checkpoint)
        mem = step.memory(model, seq_len, d, r, u, b, expert)
        _check_memory(mem, budget, step.mem_fraction, cluster, d)
        rule = "host_memory"
        host = 0.0 if step.forward_only else host_bytes(model, cluster, seq_len, d, r, u, b,
                                                         step.dtype_bytes, step.checkpoint)
        check_host(host, cluster, step.mem_fraction)
    except ValueError as e:
        return Dropped(d, r, u, str(e), rule, expert)
    return Candidate(d, r, u, cost, _notes(model, cluster, cost, search.placement), mem, b,
                     expert, model, host)


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


def check_host(host: float, cluster: ClusterSpec, mem_fraction: float) -> None:
    """Refuse a layout whose offloads need more host memory per node (``host``,
    ``offload.host_bytes``) than ``mem_fraction`` of ``cluster.host_mem_bytes``."""
    budget = mem_fraction * cluster.host_mem_bytes
    if host <= budget:
        return
    raise ValueError(f"needs {size(host)} of host memory per node for the offloaded state and "
                     f"checkpoint inputs > {size(budget)} ({mem_fraction:.0%} of host_mem_bytes "
                     f"{size(cluster.host_mem_bytes)}); try more nodes, checkpoint_every > 1, "
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
    if cost.expert > 1:
        notes.append(f"experts over {cost.expert} ranks "
                     f"{'across nodes' if cost.expert_link == 'inter' else 'in node'}: "
                     f"a2a {size(cost.expert_a2a_bytes)}/seq")
    if r > 1:
        notes.append(f"ring {'across nodes' if cost.ring_link == 'inter' else 'in node'}")
        if cost.ring_exposed_s > 0:
            notes.append(f"ring comm {cost.ring_exposed_s / cost.ring_comm_s:.0%} exposed")
    return notes
