"""The planner's answer: the feasible layouts ranked by predicted step time per sequence
(``Candidate``), the refused ones with the rule that refused them (``Dropped``), and the
``Plan`` that holds both: why the best layout won, the ranked table, the best layout's
memory split and the batch that fits a token budget. ``plan.plan`` builds it."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..config import ModelConfig
from ..dims.counts import divisors
from ..dims.heads import head_split
from ..config.cluster import ClusterSpec
from .cost import StepCost
from .experts import expert_sync
from .fit import longest_seq_len
from .memory import MemorySplit, size
from .options import BatchSpec, Search, StepPolicy
from .tiles import TILE_SHARE


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
    expert: int = 1  # expert degree (a mixture of experts)
    model: ModelConfig | None = None  # as priced: an auto loss_chunk/mlp_tiles sized for it
    host: float = 0.0  # host memory per node its offloads hold (``offload.host_bytes``)

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
        experts = f", expert {self.expert}" if self.expert > 1 else ""
        return f"ulysses {self.ulysses} x ring {self.ring} x dp {self.dp}{experts}"


@dataclass
class Dropped:
    """An infeasible layout, the rule that refused it (``RULES``) and the rule's message."""

    dp: int
    ring: int
    ulysses: int
    reason: str
    rule: str = ""
    expert: int = 1

    def line(self) -> str:
        experts = f" expert {self.expert}" if self.expert > 1 else ""
        return f"dp {self.dp} ring {self.ring} ulysses {self.ulysses}{experts}: {self.reason}"


# plan()'s checks, in order
RULES = ("degrees", "batch", "heads", "seq_len", "memory", "host_memory")


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
    search: Search  # the layouts it was asked to rank
    batch: BatchSpec  # the sequences each layout runs (``Candidate.batch`` per dp rank)
    step: StepPolicy  # how every rank runs the step

    @property
    def budget(self) -> float:
        """Bytes per rank a layout may use."""
        return self.step.budget(self.cluster)

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
        longest = longest_seq_len(self.model, self.budget, c.dp, c.ring, c.ulysses, self.step,
                                  balance=self.search.balance, batch=c.batch, expert=c.expert,
                                  cluster=self.cluster)
        tiles = tiles_text(self.model, c.model)
        return (f"memory per rank ({c.label()}), peak at {c.memory.peak_at}:\n"
                f"  {c.memory.line(self.budget)}\n{self.host_text(c)}{tiles}"
                f"longest seq_len that fits this layout: {longest} "
                f"(x{longest / self.seq_len:.2f} of {self.seq_len})")

    def host_text(self, c: Candidate | None = None) -> str:
        """With an offload on, the host memory layout ``c`` (default the best) uses per node
        against the usable share (the host rule's) and what the copies and the host optimizer
        add to its step, with a newline; "" without."""
        c, policy = c or self.best, self.step.checkpoint
        if not (policy.offload or policy.state_offload):
            return ""
        usable = self.step.mem_fraction * self.cluster.host_mem_bytes
        return (f"  host memory per node {size(c.host)} of {size(usable)}; offloads add "
                f"{c.cost.offload_s:.2f} s a step\n")

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
        grads = 4 * sum(expert_sync(self.model, c.expert))  # FSDP holds them unsharded,
        for b in sorted(divisors(per_rank), reverse=True):  # in fp32, between micro-batches
            peak = self.step.memory(self.model, self.seq_len, c.dp, c.ring, c.ulysses, b,
                                    c.expert, self.budget).total
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

    def find(self, dp: int, ring: int, ulysses: int, expert: int | None = None) -> Candidate | None:
        """The fastest candidate of these degrees (and ``expert``, when given)."""
        return next((c for c in self.candidates if c.degrees == (dp, ring, ulysses)
                     and expert in (None, c.expert)), None)

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
        return f"{c.seq_s / self.best.seq_s - 1:+.1%} time per sequence"

    def format_table(self, show_dropped: bool = True, max_dropped: int = 20) -> str:
        """Ranked table of feasible layouts, then the dropped ones with their reason: one line
        each up to ``max_dropped`` of them, else a count per rule with a few examples."""
        c0 = self.cluster
        head = (
            f"plan: world {self.world} ({c0.nodes} x {c0.ranks_per_node} on {c0.name}), "
            f"seq_len {self.seq_len}, {self.batch.text()}, {self.search.balance}"
            + (", memory forward only (no gradients, no optimizer state)"
               if self.step.forward_only else "")
        )
        moe = self.model.n_experts is not None  # an expert column beside the degrees

        def ex(n) -> str:
            return f" {n:>6}" if moe else ""

        rows = [head, f"{'#':>2} {'dp':>3} {'ring':>4} {'ulysses':>7}{ex('expert')} {'s/seq':>8} "
                f"{'vs best':>8} {'s/pass':>8} {'seqs':>5} {'comm':>6} {'mem/rank':>9}  notes"]
        t0 = self.best.seq_s
        for i, c in enumerate(self.candidates, 1):
            k = c.cost
            rows.append(
                f"{i:>2} {c.dp:>3} {c.ring:>4} {c.ulysses:>7}{ex(c.expert)} {c.seq_s:>8.4g} "
                f"{c.seq_s / t0 - 1:>+8.1%} {k.step_s:>8.3f} {c.global_batch:>5} "
                f"{k.comm_share:>6.1%} {size(c.memory.total):>9}  {'; '.join(c.notes)}"
            )
        rows.append("(s/seq: predicted seconds per sequence, what the table ranks and 'vs best' "
                    "compares; s/pass: one pass of every dp rank's micro-batch, seqs sequences; "
                    "an optimizer step is grad_accum_steps passes)")
        if show_dropped and len(self.dropped) > max_dropped:
            rows.append(f"dropped: {len(self.dropped)} layouts, by rule")
            rows += summarize_dropped(self.dropped)
        elif show_dropped and self.dropped:
            rows.append("dropped:")
            rows += [f"   {d.dp:>3} {d.ring:>4} {d.ulysses:>7}{ex(d.expert)}  {d.reason}"
                     for d in self.dropped]
        rows.append(f"reason: {self.reason}")
        return "\n".join(rows)


def tiles_text(asked: ModelConfig, priced: ModelConfig | None) -> str:
    """The line that says what an ``auto`` ``loss_chunk``/``mlp_tiles`` was sized to on a
    layout (``priced``: its ``Candidate.model``), with a newline; "" when neither was auto."""
    if priced is None or not asked.planned:
        return ""
    picked = ", ".join(f"model.{k}=auto -> {getattr(priced, k)}" for k in asked.planned)
    return f"  {picked} (each term under 1/{round(1 / TILE_SHARE)} of the budget)\n"
