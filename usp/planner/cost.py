"""Analytic step-time and memory model for one ``(dp, ring, ulysses)`` layout.

Per rank, per layer, per sequence (``T = L/P`` tokens, ``P = ring * ulysses``):

- token-wise matmuls: ``2 N_layer`` FLOPs per token forward, ``4 N_layer`` backward (and a
  second forward under activation checkpointing);
- ulysses: two all-to-alls forward (q/k/v in, out back) and their mirrors in
  backward; blocking, or with ``a2a_chunks = c > 1`` pipelined over c head stages
  (``a2a_pass``): each stage's message hides behind the neighbouring stage's ring pass
  and every message pays the link latency again. The in-a2a sends ``(u-1) T (h + 2 kv) d`` elements, with ``h`` the query
  heads and ``kv`` the KV heads of the busiest rank (``head_split``/``check_heads``; ``h =
  Hq/u`` when the heads divide), the out-a2a ``(u-1) T h d``. Peers on the same node go over
  ``intra_bw``, peers on other nodes over ``inter_bw``, in parallel; where GPUs share a
  link (``gpus_per_nic``, ``gpus_per_intra_link``) the node's concurrent senders split it;
- ring: ``r`` steps over query block ``L/r`` x key block ``L/r`` with ``h`` heads. Step
  ``i`` computes block ``i`` while block ``i+1``'s K/V travel (backward: K/V plus the fp32
  dK/dV accumulators) over the ring's slowest hop, so a step costs
  ``max(compute + merge, transfer)``; what a transfer adds beyond the compute it hides
  behind is *exposed* (``ring_pass`` has the schedule, including the last dK/dV hop home
  that only half a diagonal block can hide). Each step after the first
  merges its partial output into an fp32 accumulator (forward: out/LSE; backward: dQ, dK,
  dV), a memory-bound pass over HBM. Causal attention with zigzag balance does half a
  block per step; with contiguous balance the last ring rank does full blocks, so each
  step waits for it;
- gradients: FSDP all-gathers parameters forward and backward and reduce-scatters
  gradients over all ``dp x sp`` ranks, overlapped with compute except the last layer;
  replicated data parallel all-reduces once;
- offloads (``offload``, with a ``policy`` that offloads): the host<->device copies of the
  state and the checkpointed inputs, hidden behind compute but for one layer's, and the
  optimizer step on the host, added whole.

``attention_cost`` is the attention part (all-to-alls, ring pass, merges) alone; the
calibration (``usp.planner.calibration``) compares it with measured attention calls.

The model is a ranking tool: absolute times are optimistic by the usual kernel and NCCL
inefficiencies folded into ``mfu`` and line-rate bandwidths.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import ModelConfig
from ..dims.stages import check_a2a_chunks
from ..rules import BALANCES
from ..dims.heads import check_heads, head_split
from ..config.cluster import ClusterSpec
from .cluster import GroupSpan, group_span
from .experts import expert_a2a_bytes, expert_a2a_count, expert_a2a_s, expert_link, expert_sync
from .memory import CheckpointPolicy, memory_split
from .offload import offload_time
from .schedule import FLASH_BWD, a2a_pass, ring_pass
from .traffic import (band_share, layer_mean_bytes, layer_windows, ring_kv_heads,
                      windowed_ring_hops)

FP32 = 4  # bytes: LSE, merge accumulators, dK/dV in flight, logits for the loss


@dataclass
class StepCost:
    """Predicted cost of one optimizer step on one rank. Times in seconds, sizes in bytes."""

    dp: int
    ring: int
    ulysses: int
    kv_per_rank: int  # KV heads each ulysses rank attends with (1 when replicated)
    compute_s: float  # attention + matmul FLOPs / (peak * mfu), recompute included
    attn_s: float  # the attention part of compute_s
    a2a_s: float  # ulysses all-to-all time the compute waits for (all of it unpipelined)
    ring_comm_s: float  # K/V (and dK/dV) transfer time, hidden or not
    ring_exposed_s: float  # the part of ring_comm_s not hidden behind block compute
    ring_tail_s: float  # of which: the last dK/dV hop home (only half a diagonal beside it)
    merge_s: float  # ring out/LSE and gradient accumulation (HBM-bound)
    grad_s: float  # gradient reduction / FSDP gathers, total transfer time
    grad_exposed_s: float  # the part of grad_s not overlapped with compute
    step_s: float  # predicted step time
    a2a_bytes: float  # per rank per layer per sequence, fwd+bwd (no recompute)
    ring_bytes: float  # per rank per layer per sequence, fwd+bwd (no recompute)
    mem_bytes: float  # peak memory per rank
    mem_state_bytes: float  # params + grads + optimizer (+ gathered FSDP layers)
    mem_act_bytes: float  # activations, attention buffers, logits
    a2a_link: str  # "intra", "inter" or "-" (ulysses 1)
    ring_link: str  # "intra", "inter" or "-" (ring 1)
    a2a_chunks: int = 1  # pipeline stages of the ulysses all-to-alls
    expert: int = 1  # expert degree (a mixture of experts; 1: every rank holds every expert)
    expert_a2a_s: float = 0.0  # expert dispatch/combine all-to-all time, exposed (experts.py)
    expert_a2a_bytes: float = 0.0  # per rank per sequence, all sparse layers, recompute included
    expert_link: str = "-"  # "intra", "inter" or "-" (expert degree 1)
    offload_s: float = 0.0  # what the offloads add: exposed copies + host optimizer step

    @property
    def comm_share(self) -> float:
        """Share of the step spent waiting on communication."""
        waits = self.a2a_s + self.ring_exposed_s + self.grad_exposed_s + self.expert_a2a_s
        return waits / self.step_s if self.step_s > 0 else 0.0


def layer_params(model: ModelConfig) -> int:
    """Weights of one decoder layer: its matmuls and its two RMSNorm vectors."""
    return model.layer_matmul_params() + 2 * model.dim


def layer_matmul_params(model: ModelConfig) -> int:
    """Weights one token multiplies through in a layer (``ModelConfig.layer_matmul_params``)."""
    return model.layer_matmul_params()


def ring_step_link(cluster: ClusterSpec, span: GroupSpan) -> tuple[float, float]:
    """(bytes/s, latency s) of one ring step: every member sends at once, so the step
    lasts as long as its slowest hop, on links shared by the node's concurrent senders."""
    if not span.crosses:
        return cluster.link_bw(False, span.intra_senders), cluster.intra_latency_s
    bw = cluster.link_bw(True, span.inter_senders)
    if span.intra_senders:  # some hops stay inside a node
        bw = min(bw, cluster.link_bw(False, span.intra_senders))
    return bw, cluster.inter_latency_s


def a2a_stage_times(cluster: ClusterSpec, span: GroupSpan, tokens: float, hq: int, kv: int,
                    head_dim: int, dtype_bytes: int, chunks: int) -> tuple[float, float]:
    """(in, out) seconds of one pipeline stage's all-to-all message on a rank of ``tokens``
    tokens that attends with ``hq`` query and ``kv`` KV heads: the in-a2a moves ``hq + 2 kv``
    heads per token, the out-a2a ``hq``, ``1/chunks`` of them per stage. Peers on the node go
    over ``intra_bw``, peers on other nodes over ``inter_bw``, in parallel, on links shared by
    the node's concurrent senders; every message pays the link's latency."""
    intra_bw = cluster.link_bw(False, span.intra_senders)
    inter_bw = cluster.link_bw(True, span.inter_senders)
    lat = cluster.inter_latency_s if span.remote_peers else cluster.intra_latency_s

    def message(heads: int) -> float:
        chunk = tokens * heads * head_dim * dtype_bytes / chunks  # bytes to each peer
        local = span.local_peers * chunk / intra_bw
        remote = span.remote_peers * chunk / inter_bw
        return lat + max(local, remote)

    return message(hq + 2 * kv), message(hq)


@dataclass(frozen=True)
class AttentionCost:
    """One attention layer on one rank for one sequence: ``n_fwd`` forward passes and one
    backward. Times in seconds."""

    compute_s: float  # kernel FLOPs / (peak * mfu)
    merge_s: float  # ring out/LSE and gradient accumulation (HBM-bound)
    a2a_s: float  # ulysses all-to-all time the compute waits for
    ring_comm_s: float  # K/V (and dK/dV) transfer time, hidden or not
    ring_exposed_s: float  # the part of ring_comm_s not hidden behind block compute
    ring_tail_s: float  # of which: the last dK/dV hop home
    a2a_comm_s: float  # ulysses all-to-all transfer time, hidden or not
    a2a_chunks: int  # pipeline stages of the all-to-alls (1 without a ulysses group)
    a2a_link: str  # "intra", "inter" or "-" (ulysses 1)
    ring_link: str  # "intra", "inter" or "-" (ring 1)

    @property
    def total_s(self) -> float:
        """What the layer's attention adds to the step: compute, merges and waits."""
        return self.compute_s + self.merge_s + self.a2a_s + self.ring_exposed_s


def attention_cost(cluster: ClusterSpec, seq_len: int, hq: int, hkv: int, head_dim: int,
                   ulysses: int, ring: int, *, dp: int = 1, dtype_bytes: int = 2,
                   causal: bool = True, balance: str = "zigzag",
                   placement: str = "ulysses_inner", n_fwd: int = 1,
                   overlap: float | None = None, causal_tile: float = 0.0,
                   a2a_chunks: int = 1, a2a_overlap: float | None = None,
                   window: int | None = None) -> AttentionCost:
    """The attention part of ``estimate``: ``[1, L, hq|hkv, head_dim]`` over ``ulysses x
    ring`` ranks (``dp`` replicas placed by ``placement``).

    ``overlap``: share of a ring transfer that the block computed beside it hides (default
    ``cluster.overlap``). ``causal_tile``: tokens of extra work on a causal diagonal block,
    whose cost is ``(1 + causal_tile / block)`` times its half square (the mask's cut tiles
    computed whole); 0 counts the half square only. ``a2a_chunks``: pipeline stages of
    the ulysses all-to-alls (``usp_attention``'s); the ring runs once per stage, each with
    ``1/a2a_chunks`` of the compute and of the K/V heads sent
    (``traffic.ring_kv_heads``), so its messages also pay their latency more often.
    ``a2a_overlap``: share of a pipelined stage's all-to-all that the neighbouring stage's
    compute hides (default ``cluster.a2a_overlap``, else ``overlap``).
    """
    overlap = cluster.overlap if overlap is None else overlap
    if a2a_overlap is None:
        a2a_overlap = overlap if cluster.a2a_overlap is None else cluster.a2a_overlap
    _check_cost_args(balance, n_fwd, overlap, causal_tile)
    L, r, u, hd = seq_len, ring, ulysses, head_dim
    kv = check_heads(hq, hkv, u)
    c = check_a2a_chunks(a2a_chunks, hq, hkv, u) if u > 1 else 1
    # the busiest ulysses rank sets the pace: with an uneven head split (``head_split``)
    # it holds more than Hq/u query heads
    hq_u = max(head_split(hq, hkv, u).q_counts)
    T = L / (r * u)  # tokens per rank
    rate = cluster.peak_flops * cluster.mfu  # FLOP/s

    # ---- ulysses all-to-alls: [B, L/P, H, d] <-> [B, L/r, H/u, d] ---------------------
    a2a_s, a2a_link = 0.0, "-"
    if u > 1:
        us = group_span(dp, r, u, cluster.ranks_per_node, "ulysses", placement)
        a2a_link = "inter" if us.remote_peers else "intra"
        t_in, t_out = a2a_stage_times(cluster, us, T, hq_u, kv, hd, dtype_bytes, c)

    # ---- ring pass: r steps of [L/r queries x L/r keys x h heads] ---------------------
    blk = L / r  # tokens per ring segment
    blk_flops = 4 * blk * blk * hq_u * hd  # QK^T and PV, one full block
    full = blk_flops / rate
    first = full / 2 * (1 + causal_tile / blk) if causal else full  # the diagonal block
    # slowest rank's block; per_document (usp.dims.balance) priced as perfectly balanced
    later = full / 2 if causal and balance in ("zigzag", "per_document") else full
    attn_fwd = (first + (r - 1) * later) * band_share(L, window, causal)
    hops = windowed_ring_hops(L, r, balance, causal, window)
    ring_kv = max(ring_kv_heads(hq, hkv, u, j, c) for j in range(u)) / c  # per stage
    kv_bytes = 2 * blk * ring_kv * hd * dtype_bytes  # one stage's K/V block in flight
    q_elems, kv_elems = blk * hq_u * hd / c, blk * ring_kv * hd  # one stage
    merge_f = 3 * FP32 * q_elems / cluster.hbm_bw  # read acc + block, write acc
    merge_b = 3 * FP32 * (q_elems + 2 * kv_elems) / cluster.hbm_bw  # dQ, dK, dV
    comm = exposed = merge = tail = 0.0
    ring_link = "-"
    if hops:
        rs = group_span(dp, r, u, cluster.ranks_per_node, "ring", placement)
        ring_link = "inter" if rs.crosses else "intra"
        bw, lat = ring_step_link(cluster, rs)
        send_kv = lat + kv_bytes / bw
        send_acc = lat + kv_bytes * FP32 / dtype_bytes / bw  # fp32 dK/dV accumulator
        comm, exposed, tail = (c * x for x in ring_pass(
            hops + 1, n_fwd, send_kv, send_acc, first / c, later / c, merge_f, merge_b, overlap))
        merge = c * hops * (n_fwd * merge_f + merge_b)
    a2a_s = a2a_comm = 0.0
    if u > 1:  # fwd (x recompute) and the bwd mirror: output grads in, dq/dk/dv out
        stage = attn_fwd / c  # one stage's forward kernel time
        a2a_s = (n_fwd * a2a_pass(c, t_in, t_out, stage, a2a_overlap)
                 + a2a_pass(c, t_out, t_in, FLASH_BWD * stage, a2a_overlap))
        a2a_comm = (n_fwd + 1) * c * (t_in + t_out)
    return AttentionCost(compute_s=(n_fwd + FLASH_BWD) * attn_fwd, merge_s=merge, a2a_s=a2a_s,
                         ring_comm_s=comm, ring_exposed_s=exposed, ring_tail_s=tail,
                         a2a_comm_s=a2a_comm, a2a_chunks=c, a2a_link=a2a_link,
                         ring_link=ring_link)


def _check_cost_args(balance: str, n_fwd: int, overlap: float, causal_tile: float) -> None:
    if (balance not in BALANCES or n_fwd < 1 or not 0 <= overlap <= 1
            or causal_tile < 0):
        raise ValueError(f"attention_cost needs balance in {BALANCES}, "
                         f"n_fwd >= 1, overlap in "
                         f"[0, 1] and causal_tile >= 0; got balance={balance!r}, "
                         f"n_fwd={n_fwd}, overlap={overlap}, causal_tile={causal_tile}")


def best_a2a_chunks(cluster: ClusterSpec, seq_len: int, hq: int, hkv: int, head_dim: int,
                    ulysses: int, ring: int, *, max_chunks: int = 8, **kw) -> int:
    """The ``a2a_chunks`` (1 .. ``max_chunks``, within ``check_a2a_chunks``) whose
    ``attention_cost`` total is least, the fewest stages on a tie; 1 without a ulysses
    group and when the ulysses group stays inside a node (there, ranks that share a host's
    cores gain nothing from hiding a fast transfer and pay for the extra messages).
    ``kw`` goes to ``attention_cost`` (dp, dtype_bytes, causal, balance, ...)."""
    if ulysses == 1:
        return 1
    span = group_span(kw.get("dp", 1), ring, ulysses, cluster.ranks_per_node, "ulysses",
                      kw.get("placement", "ulysses_inner"))
    if not span.remote_peers:
        return 1
    most = min(max_chunks, max(head_split(hq, hkv, ulysses).q_counts))
    totals = {c: attention_cost(cluster, seq_len, hq, hkv, head_dim, ulysses, ring,
                                a2a_chunks=c, **kw).total_s for c in range(1, most + 1)}
    return min(totals, key=lambda c: (totals[c], c))


def choose_a2a_chunks(chunks, cluster: ClusterSpec, seq_len: int, hq: int, hkv: int,
                      head_dim: int, ulysses: int, ring: int, **kw) -> int:
    """The one rule for a layout's ``a2a_chunks``: ``"auto"``: ``best_a2a_chunks`` (``kw``
    as there); an int: checked against the heads (``check_a2a_chunks``) and returned."""
    if chunks == "auto":
        return best_a2a_chunks(cluster, seq_len, hq, hkv, head_dim, ulysses, ring, **kw)
    return check_a2a_chunks(chunks, hq, hkv, ulysses)


def grad_sync_s(model: ModelConfig, cluster: ClusterSpec, world: int, seqs: float,
                dtype_bytes: int, fsdp: bool, expert_degree: int = 1) -> float:
    """Transfer seconds of one step's gradient collectives over all ``world`` ranks, each
    dp rank running ``seqs`` sequences: on the slowest link the collective touches, shared
    by the node's ranks, which all take part at once. FSDP all-gathers the parameters in
    forward and backward of every sequence and reduce-scatters the gradients once;
    replicated data parallel all-reduces them once (a reduce-scatter and an all-gather).
    Every layer's collective pays the link's latency. With ``expert_degree`` N > 1 a rank's
    ``E/N`` experts sync over the ``W/N`` ranks outside its expert group (``experts``), the
    rest of the model over all ``W``."""
    if world == 1:
        return 0.0
    nl = model.n_layers
    n_params, held = expert_sync(model, expert_degree) if expert_degree > 1 else \
        (model.num_params(), 0.0)
    spans_nodes = world > cluster.ranks_per_node
    gbw = cluster.link_bw(spans_nodes, min(world, cluster.ranks_per_node))
    glat = cluster.inter_latency_s if spans_nodes else cluster.intra_latency_s
    frac = (world - 1) / world
    outside = world // expert_degree  # the ranks a rank's experts are sharded over
    moved = frac * n_params + (outside - 1) / outside * held  # both on the slowest link
    if fsdp:
        return (2 * seqs + 1) * (moved * dtype_bytes / gbw + nl * glat)
    return 2 * moved * dtype_bytes / gbw + nl * glat


def estimate(model: ModelConfig, cluster: ClusterSpec, seq_len: int, dp: int, ring: int,
             ulysses: int, *, global_batch: int = 1, dtype_bytes: int = 2, causal: bool = True,
             fsdp: bool = True, balance: str = "zigzag", placement: str = "ulysses_inner",
             act_checkpoint: bool = True, a2a_chunks: int = 1,
             expert_degree: int = 1, policy: CheckpointPolicy | None = None) -> StepCost:
    """Predict one step of ``global_batch`` sequences of ``seq_len`` tokens.

    Each dp rank runs ``global_batch / dp`` sequences in one forward (the trainer's batch
    dimension; timed as that many sequences); memory (``usp.planner.memory.memory_split``)
    holds all of them at once, on the busiest ulysses rank when the
    heads split unevenly. ``a2a_chunks``: pipeline stages of the ulysses all-to-alls
    (``attention_cost``). ``expert_degree``: a mixture of experts' (``_expert_cost``).
    ``policy``: the checkpoint policy with its offloads (``offload.offload_time``); None:
    ``CheckpointPolicy(act_checkpoint)``, no offload. Raises ``ValueError`` when the heads
    cannot split over ``ulysses`` (see ``usp.dims.heads.head_split``) or into ``a2a_chunks`` stages.
    """
    L, r, u, P = seq_len, ring, ulysses, ring * ulysses
    world = dp * P
    hq, hkv, hd, D = model.n_heads, model.n_kv_heads, model.head_dim, model.dim
    kv = check_heads(hq, hkv, u)
    seqs = global_batch / dp  # micro-batches of one sequence per dp rank
    T = L / P  # tokens per rank
    rate = cluster.peak_flops * cluster.mfu  # FLOP/s
    n_fwd = 2 if act_checkpoint else 1  # forward passes per layer (recompute)

    # ---- token-wise compute, per layer per sequence -----------------------------------
    # a layer's mean (a sparse layer: its router and the k experts a token runs)
    lin_s = (2 * n_fwd + 4) * (model.matmul_params() / model.n_layers) * T / rate
    head_s = 6 * D * model.vocab_size * T / rate  # LM head fwd+bwd, once per sequence

    # ---- attention: ulysses all-to-alls and the ring pass, each layer per sequence -------
    # layer by layer: a local layer (a window shorter than L) costs its band, not L
    atts = [(n, attention_cost(cluster, L, hq, hkv, hd, u, r, dp=dp, dtype_bytes=dtype_bytes,
                               causal=causal, balance=balance, placement=placement,
                               n_fwd=n_fwd, a2a_chunks=a2a_chunks, window=w))
            for n, w in layer_windows(model, L)]
    att = atts[0][1]  # the links and stages, alike on every layer

    def layers(part: str) -> float:  # seconds of ``part`` over all layers, one sequence
        return sum(n * getattr(a, part) for n, a in atts)

    sent = layer_mean_bytes(model, L, u, r, dtype_bytes, balance, causal, att.a2a_chunks)

    # ---- one step ------------------------------------------------------------------------
    nl = model.n_layers
    ex = _expert_cost(model, cluster, dp, r, u, expert_degree, T, dtype_bytes, act_checkpoint,
                      placement)
    per_seq = (nl * lin_s + layers("compute_s") + layers("a2a_s") + layers("ring_exposed_s")
               + layers("merge_s") + head_s + ex["expert_a2a_s"])
    compute_s = seqs * (nl * lin_s + layers("compute_s") + head_s)

    grad_s = grad_sync_s(model, cluster, world, seqs, dtype_bytes, fsdp, expert_degree)
    grad_exposed = max(grad_s / nl, grad_s - compute_s) if grad_s else 0.0
    policy = policy or CheckpointPolicy(act_checkpoint)
    off = offload_time(model, cluster, L, dp, r, u, seqs, dtype_bytes, policy, compute_s)
    step_s = seqs * per_seq + grad_exposed + off.added_s

    # ---- memory per rank: usp.planner.memory ------------------------------------------------
    mem = memory_split(model, L, dp, r, u, batch=max(1, global_batch // dp),
                       dtype_bytes=dtype_bytes, fsdp=fsdp, policy=policy,
                       expert_degree=expert_degree)

    return StepCost(
        dp=dp, ring=r, ulysses=u, kv_per_rank=kv, compute_s=compute_s,
        attn_s=seqs * layers("compute_s"), a2a_s=seqs * layers("a2a_s"),
        ring_comm_s=seqs * layers("ring_comm_s"), ring_exposed_s=seqs * layers("ring_exposed_s"),
        ring_tail_s=seqs * layers("ring_tail_s"), merge_s=seqs * layers("merge_s"),
        grad_s=grad_s, grad_exposed_s=grad_exposed, step_s=step_s,
        a2a_bytes=sent["ulysses"], ring_bytes=sent["ring"],
        mem_bytes=mem.total, mem_state_bytes=mem.state,
        mem_act_bytes=mem.activations + mem.attention + mem.mlp + mem.logits,
        a2a_link=att.a2a_link, ring_link=att.ring_link, a2a_chunks=att.a2a_chunks,
        offload_s=off.added_s, **{**ex, "expert_a2a_s": seqs * ex["expert_a2a_s"]},
    )


def _expert_cost(model: ModelConfig, cluster: ClusterSpec, dp: int, ring: int, ulysses: int,
                 degree: int, tokens: float, dtype_bytes: int, recompute: bool,
                 placement: str) -> dict:
    """``StepCost``'s expert fields for one sequence (``experts``): the dispatch and combine
    all-to-alls, exposed (the experts wait for their tokens), their bytes and link."""
    n = expert_a2a_count(recompute, model.mlp_tiles > 1)
    return dict(expert=degree,
                expert_a2a_s=expert_a2a_s(cluster, model, dp, ring, ulysses, degree, tokens,
                                          dtype_bytes, n, placement),
                expert_a2a_bytes=expert_a2a_bytes(model, tokens, degree, dtype_bytes, n),
                expert_link=expert_link(dp, ring, ulysses, cluster.ranks_per_node, degree,
                                        placement))
