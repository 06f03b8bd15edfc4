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

from dataclasses import dataclass, field

from ..config import ModelConfig
from ..validate import check_degrees, check_placement, check_seq_len
from ..dims.heads import check_heads, head_split
from ..config.cluster import GiB, ClusterSpec
from .cluster import group_span
from .cost import StepCost, choose_a2a_chunks, estimate
from .memory import CheckpointPolicy, MemorySplit, max_seq_len, memory_split, size


@dataclass
class Candidate:
    """A feasible layout with its predicted cost and notes (replication, spans)."""

    dp: int
    ring: int
    ulysses: int
    cost: StepCost
    notes: list[str] = field(default_factory=list)
    memory: MemorySplit | None = None  # per rank, the busiest ulysses rank
    batch: int = 1  # sequences per dp rank

    @property
    def degrees(self) -> tuple[int, int, int]:
        return self.dp, self.ring, self.ulysses

    @property
    def global_batch(self) -> int:
        """Sequences per step over all dp ranks."""
        return self.batch * self.dp

    @property
    def seq_s(self) -> float:
        """Step time per sequence of the global batch: what ``plan`` ranks by."""
        return self.cost.step_s / self.global_batch

    def label(self) -> str:
        return f"ulysses {self.ulysses} x ring {self.ring} x dp {self.dp}"


@dataclass
class Dropped:
    """An infeasible layout, the rule that refused it (``RULES``) and the rule's message."""

    dp: int
    ring: int
    ulysses: int
    reason: str
    rule: str = ""

    def line(self) -> str:
        return f"dp {self.dp} ring {self.ring} ulysses {self.ulysses}: {self.reason}"


RULES = ("degrees", "batch", "heads", "seq_len", "memory")  # plan()'s checks, in order


def group_dropped(dropped: list[Dropped]) -> dict[str, list[Dropped]]:
    """Dropped layouts by the rule that refused them, in the order ``plan`` checks them."""
    order = {rule: i for i, rule in enumerate(RULES)}
    groups: dict[str, list[Dropped]] = {}
    for d in sorted(dropped, key=lambda d: order.get(d.rule, len(RULES))):
        groups.setdefault(d.rule or "other", []).append(d)
    return groups


def summarize_dropped(dropped: list[Dropped], examples: int = 2) -> list[str]:
    """One line per rule: how many layouts it dropped, then up to ``examples`` of them."""
    lines = []
    for rule, ds in group_dropped(dropped).items():
        lines.append(f"  {rule}: {len(ds)} layout{'s' if len(ds) > 1 else ''}, e.g.")
        lines += [f"    {d.line()}" for d in ds[:examples]]
    return lines


@dataclass
class Plan:
    """Ranked feasible layouts (fastest first), dropped ones, and a one-line reason."""

    world: int
    seq_len: int
    cluster: ClusterSpec
    model: ModelConfig
    candidates: list[Candidate]
    dropped: list[Dropped]
    batch_per_dp_rank: int | None = 1  # None: ``fixed_global_batch`` split over dp
    balance: str = "zigzag"
    fixed_global_batch: int | None = None
    budget: float = 0.0  # bytes per rank a layout may use
    memory_kw: dict = field(default_factory=dict)  # memory_split's keywords for this plan

    @property
    def best(self) -> Candidate:
        return self.candidates[0]

    @property
    def global_batch(self) -> int:
        """Sequences per step of the best layout."""
        return self.best.global_batch

    def memory_text(self, c: Candidate | None = None) -> str:
        """The memory split of layout ``c`` (default the best) against the budget, and the
        longest sequence whose peak fits that budget with the same layout and features."""
        c = c or self.best
        longest = max_seq_len(self.model, self.budget, c.dp, c.ring, c.ulysses,
                              balance=self.balance, batch=c.batch, **self.memory_kw)
        return (f"memory per rank ({c.label()}), peak at {c.memory.peak_at}:\n"
                f"  {c.memory.line(self.budget)}\n"
                f"longest seq_len that fits this layout: {longest} "
                f"(x{longest / self.seq_len:.2f} of {self.seq_len})")

    def batch_for_tokens(self, tokens: int, c: Candidate | None = None) -> tuple[int, int, float]:
        """(batch_per_dp_rank, grad_accum_steps, peak bytes per rank) that make a global
        batch of ``tokens`` tokens on layout ``c`` (default the best): the largest per-rank
        batch whose peak fits the budget, the rest by accumulation. With accumulation the
        peak includes the unsharded fp32 gradients FSDP holds between micro-batches (4
        bytes per parameter on every rank). ValueError when
        ``tokens`` is no whole number of sequences per dp rank, or one sequence does not
        fit."""
        c = c or self.best
        per_rank, rest = divmod(tokens, self.seq_len * c.dp)
        if rest or not per_rank:
            step = self.seq_len * c.dp
            raise ValueError(f"trainer.global_batch_tokens={tokens} is no whole number of "
                             f"sequences for each of dp {c.dp} ranks (seq_len {self.seq_len} "
                             f"x dp {c.dp} = {step} tokens); use a multiple of {step}")
        grads = 4 * self.model.num_params()  # FSDP holds them unsharded, in fp32, between
        for b in sorted(_divisors(per_rank), reverse=True):  # micro-batches
            peak = memory_split(self.model, self.seq_len, c.dp, c.ring, c.ulysses, batch=b,
                                **self.memory_kw).total
            if per_rank // b > 1:
                peak += grads
            if peak <= self.budget:
                return b, per_rank // b, peak
        if per_rank > 1 and peak - grads <= self.budget:
            raise ValueError(f"{per_rank} sequences per dp rank need grad_accum_steps "
                             f"{per_rank} at one per micro-batch, and between micro-batches "
                             f"FSDP holds the unsharded fp32 gradients ({size(grads)}): peak "
                             f"{size(peak)} > budget {size(self.budget)} on {c.label()}; use "
                             f"more dp ranks or trainer.global_batch_tokens="
                             f"{self.seq_len * c.dp} (one sequence per dp rank, no "
                             "accumulation)")
        raise ValueError(f"one sequence of {self.seq_len} tokens per rank does not fit "
                         f"{c.label()} ({size(peak)} > budget {size(self.budget)})")

    def find(self, dp: int, ring: int, ulysses: int) -> Candidate | None:
        return next((c for c in self.candidates if c.degrees == (dp, ring, ulysses)), None)

    @property
    def reason(self) -> str:
        """Why the best layout won, in one line."""
        b, m, K = self.best, self.model, self.cluster.ranks_per_node
        hkv = m.n_kv_heads
        u, r = b.ulysses, b.ring
        parts = []
        node = " = GPUs per node" if u == K else ""
        if u > hkv:
            rep = sum(head_split(m.n_heads, hkv, u).kv_counts) / hkv
            why = f"ulysses {u}{node} > {hkv} KV heads: KV heads replicated x{rep:g}"
        elif u == hkv:
            why = f"ulysses capped at {u} = KV heads{node}"
        else:
            why = f"ulysses {u}{node}"
        bigger = [c for c in self.candidates if c.dp == b.dp and c.ulysses > u]
        if bigger:
            c = min(bigger, key=lambda c: c.ulysses)
            blame = []
            if c.cost.a2a_link == "inter":
                blame.append("crosses nodes")
            if c.ulysses > hkv >= u:
                blame.append(f"needs KV replication x{c.ulysses // hkv}")
            why += f" (ulysses {c.ulysses} {' and '.join(blame) or 'moves more'}: {self._vs(c)})"
        parts.append(why)
        if r == 1:
            parts.append("no ring")
        else:
            where = "across nodes" if b.cost.ring_link == "inter" else "inside a node"
            k = b.cost
            waits = k.ring_exposed_s / k.ring_comm_s
            hide = ("K/V and dK/dV transfers hidden behind attention"
                    if waits == 0 else f"{waits:.0%} of ring transfer exposed")
            parts.append(f"ring {r} {where}, {hide}")
            smaller = [c for c in self.candidates if c.dp == b.dp and c.ulysses < u]
            if smaller:
                c = max(smaller, key=lambda c: c.ulysses)
                lead = "replication beats " if u > hkv >= c.ulysses else ""
                parts.append(f"{lead}ring {c.ring} with ulysses {c.ulysses}: {self._vs(c)}")
        if b.dp > 1:
            parts.append(f"dp {b.dp}")
        return f"{b.label()}: " + "; ".join(parts)

    def _vs(self, c: Candidate) -> str:
        return f"{c.cost.step_s / self.best.cost.step_s - 1:+.1%} step time"

    def format_table(self, show_dropped: bool = True, max_dropped: int = 20) -> str:
        """Ranked table of feasible layouts, then the dropped ones with their reason: one line
        each up to ``max_dropped`` of them, else a count per rule with a few examples."""
        c0 = self.cluster
        head = (
            f"plan: world {self.world} ({c0.nodes} x {c0.ranks_per_node} on {c0.name}), "
            f"seq_len {self.seq_len}, {self._batch_text()}, {self.balance}"
        )
        rows = [head, f"{'#':>2} {'dp':>3} {'ring':>4} {'ulysses':>7} {'step_s':>9} "
                f"{'vs best':>8} {'comm':>6} {'mem/rank':>9}  notes"]
        t0 = self.best.seq_s
        for i, c in enumerate(self.candidates, 1):
            k = c.cost
            rows.append(
                f"{i:>2} {c.dp:>3} {c.ring:>4} {c.ulysses:>7} {k.step_s:>9.3f} "
                f"{c.seq_s / t0 - 1:>+8.1%} {k.comm_share:>6.1%} "
                f"{size(c.memory.total):>9}  {'; '.join(c.notes)}"
            )
        if show_dropped and len(self.dropped) > max_dropped:
            rows.append(f"dropped: {len(self.dropped)} layouts, by rule")
            rows += summarize_dropped(self.dropped)
        elif show_dropped and self.dropped:
            rows.append("dropped:")
            rows += [f"   {d.dp:>3} {d.ring:>4} {d.ulysses:>7}  {d.reason}" for d in self.dropped]
        rows.append(f"reason: {self.reason}")
        return "\n".join(rows)


    def _batch_text(self) -> str:
        if self.batch_per_dp_rank is None:
            return f"global batch {self.fixed_global_batch}"
        return f"batch {self.batch_per_dp_rank} per dp rank"


FIXES = {  # what lowers each memory term, for the memory rule's message
    "state": "more ranks (FSDP shards the state over all of them)",
    "activations": "trainer.activation_checkpointing=true with checkpoint_every=1 "
                   "(or activation_offload on CUDA)",
    "attention": "a larger ring degree (shorter segments)",
    "mlp": "model.mlp_tiles > 1",
    "logits": "model.loss_chunk (e.g. 8192)",
}


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


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
    for u in [ulysses] if ulysses is not None else _divisors(world):
        for r in [ring] if ring is not None else _divisors(world // u):
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
