"""The planner's ranking for a run's config, and ``usp-plan``'s report of it as text."""

from __future__ import annotations

import math
from dataclasses import replace

from ..config import PlanConfig, RunConfig
from ..dims.balance import choose_balance
from ..rules import seq_multiple
from .batch import grad_accum_steps
from .detect import DetectReport
from .draw import draw_mesh
from .experts import expert_a2a_count, expert_degrees, expert_params, sparse_layers
from .memory import CheckpointPolicy, size
from .options import BatchSpec, Search, StepPolicy
from .plan import plan
from .ranking import Plan
from .traffic import band_share, layer_windows


def config_degree(value, name: str) -> int | None:
    """An int degree, or None for ``auto`` / unset."""
    if value is None or value == "auto":
        return None
    try:
        v = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"parallel.{name} must be an integer or 'auto', got {value!r}") from None
    if v < 1:
        raise ValueError(f"parallel.{name} must be >= 1, got {v}")
    return v


def plan_run(cfg: RunConfig | PlanConfig, spec, world: int, forward_only: bool = False,
             balance: str | None = None) -> Plan:
    """The planner's ranking (``usp.planner.Plan``) of the layouts of ``world`` ranks on
    ``spec`` for this run: its model, sequence, balance, placement, fixed degrees,
    ``trainer.dtype``, checkpoint policy and kernel. Every dp the planner considers runs
    ``batch_per_dp_rank`` sequences per dp rank, as the trainer does. ``forward_only``:
    usp-eval's scoring, one forward pass of the whole model on every rank (no gradients, no
    optimizer state, no FSDP: ``StepPolicy.forward_only``). With
    ``trainer.global_batch_tokens`` (training only), a dp whose micro-batch does not divide
    the step's sequences is dropped (``step_sequences``). ``balance``: the run's, as the
    resolver decided it (None: ``parallel.balance``, ``auto`` resolved by ``choose_balance``)."""
    batch = BatchSpec(per_dp_rank=cfg.data.batch_per_dp_rank,
                      step_sequences=None if forward_only else step_sequences(cfg))
    return plan(cfg.model, spec, cfg.data.seq_len, world=world, search=run_search(cfg, balance),
                batch=batch, step=run_step(cfg, forward_only))


def step_sequences(cfg: RunConfig) -> int | None:
    """The sequences of one training step that ``trainer.global_batch_tokens`` asks for,
    when it is a whole number of micro-batches of ``data.batch_per_dp_rank`` sequences (the
    planner then drops a dp that cannot make it); None without it, or when no dp can (the
    batch's own rule, ``grad_accum_steps``, says why)."""
    tokens, L, b = cfg.trainer.global_batch_tokens, cfg.data.seq_len, cfg.data.batch_per_dp_rank
    if tokens is None or tokens % (L * b):
        return None
    return tokens // L


def run_search(cfg: RunConfig, balance: str | None = None) -> Search:
    """The layouts ``plan_run`` ranks for this run: its fixed degrees, balance (None:
    ``parallel.balance``, ``auto`` resolved by ``choose_balance``), placement."""
    pc = cfg.parallel
    if balance is None:
        balance = choose_balance(pc.balance, cfg.data.packed, pc.ring_impl)[0]
    return Search(ulysses=config_degree(pc.ulysses_degree, "ulysses_degree"),
                  ring=config_degree(pc.ring_degree, "ring_degree"),
                  dp=config_degree(pc.dp_degree, "dp_degree"), balance=balance,
                  placement=pc.placement,
                  expert=config_degree(pc.expert_degree, "expert_degree"),
                  # per_document runs the ring row by row, its all-to-alls whole
                  a2a_chunks=1 if balance == "per_document" else pc.a2a_chunks)


def run_step(cfg: RunConfig, forward_only: bool = False) -> StepPolicy:
    """How every rank of this run computes its step, as ``plan_run`` prices it."""
    pc, tc = cfg.parallel, cfg.trainer
    return StepPolicy(dtype_bytes=tc.compute_dtype.itemsize,
                      checkpoint=CheckpointPolicy.from_trainer(tc), kernel=pc.kernel,
                      device="cpu" if tc.device == "cpu" else "cuda",
                      forward_only=forward_only, fsdp=not forward_only)


def plan_table(detected: DetectReport, p: Plan) -> str:
    """The planner's choice for an ``auto`` degree as usp-train prints it before training:
    the topology it detected, then its ranking (the refused layouts left out)."""
    return f"{detected.line()}\n{p.format_table(show_dropped=False)}"


def plan_report(cfg: PlanConfig) -> tuple[str, str]:
    """usp-plan's answer: (the ranking, the memory split and the chosen mesh as text, the
    mesh drawing's object for an optional PNG)."""
    spec = cfg.cluster if cfg.nodes is None else cfg.cluster.replace(nodes=cfg.nodes)
    pc = cfg.parallel
    balance, why = choose_balance(pc.balance, cfg.data.packed, pc.ring_impl)
    cfg, rounded = rounded_up(cfg, spec.world, balance)
    p = plan_run(cfg, spec, spec.world, cfg.forward_only, balance=balance)
    best = p.best
    drawing = draw_mesh(best.dp, best.ring, best.ulysses, spec.ranks_per_node,
                        cfg.parallel.placement)
    experts = f" x expert {best.expert}" if cfg.model.n_experts is not None else ""
    text = "\n".join([*rounded, p.format_table(), *layers_text(cfg.model, cfg.data.seq_len),
                      *experts_text(p), f"balance: {balance} ({why})",
                      f"choice: dp {best.dp} x ring {best.ring} x ulysses {best.ulysses}"
                      f"{experts}",
                      global_batch_text(cfg, p), p.memory_text(), str(drawing)])
    return text, drawing


def rounded_up(cfg: PlanConfig, world: int, balance: str) -> tuple[PlanConfig, list[str]]:
    """(``cfg`` with ``data.seq_len`` rounded up to a multiple every layout of ``world`` it
    searches divides (``seq_multiple``), the line that says so, or none when it divides)."""
    search, L = run_search(cfg, balance), cfg.data.seq_len
    m = math.lcm(*(seq_multiple(u, r, balance) for _, r, u in search.layouts(world)))
    if L % m == 0:
        return cfg, []
    up = -(-L // m) * m
    return (replace(cfg, data=replace(cfg.data, seq_len=up)),
            [f"data.seq_len {L} rounded up to {up}, a multiple of {m} (every layout divides it)"])


def layers_text(model, seq_len: int) -> list[str]:
    """A line on how the layers were priced when some are local (a window shorter than the
    sequence): each kind's count and its attention's share of a full layer's; none else."""
    kinds = layer_windows(model, seq_len)
    if all(w is None for _, w in kinds):
        return []
    parts = [f"{n} full" if w is None else
             f"{n} local (window {w}: attention {band_share(seq_len, w):.3g} of a full layer's)"
             for n, w in kinds]
    return [f"layers: {' + '.join(parts)}; the step time prices each kind"]


def experts_text(p: Plan) -> list[str]:
    """Lines on how a mixture of experts was priced on the plan's choice (``experts``): its
    experts, the expert degree and the link its groups span, the experts' memory a rank holds
    and gathers, the all-to-alls' bytes and exposed time; none for a dense model."""
    m, c = p.model, p.best
    if m.n_experts is None:
        return []
    k, n, a = c.cost, c.expert, p.step.dtype_bytes
    ep, world = expert_params(m), p.world
    link = {"-": "no exchange", "intra": "inside a node", "inter": "across nodes"}
    return [f"experts: {sparse_layers(m)} sparse layers x {m.n_experts} experts of "
            f"{m.expert_ffn_dim}, top-{m.experts_per_token}: {ep / 1e9:.2f}B expert weights "
            f"of {m.num_params() / 1e9:.2f}B; expert degree {n} of "
            f"{expert_degrees(m, world)} ({link[k.expert_link]})",
            f"experts per rank: {m.n_experts // n} a layer; state {size(16 * ep / world)} "
            f"sharded (E/N over W/N ranks), {size(a * ep / sparse_layers(m) / n)} a layer "
            f"gathered; dispatch+combine a2a {size(k.expert_a2a_bytes)} a sequence "
            f"({expert_a2a_count(p.step.checkpoint.enabled, (c.model or m).mlp_tiles > 1)} a layer), "
            f"{k.expert_a2a_s:.3f} s a pass exposed"]


def global_batch_text(cfg: RunConfig, p: Plan) -> str:
    """The optimizer step's batch on the plan's choice, in sequences and tokens; given
    ``trainer.global_batch_tokens``, also the per-rank batch and accumulation that fit
    memory (``Plan.batch_for_tokens``)."""
    best, L, b = p.best, cfg.data.seq_len, cfg.data.batch_per_dp_rank
    tc = cfg.trainer
    try:
        k = grad_accum_steps(tc, L, b, best.dp)
        line = (f"global batch: {b * best.dp * k} sequences = {b * best.dp * k * L} tokens per "
                f"optimizer step (batch_per_dp_rank {b} x dp {best.dp} x grad_accum_steps {k})")
    except ValueError as e:
        line = f"global batch: {e}"
    if tc.global_batch_tokens is None:
        return line
    try:
        fit_b, fit_k, peak = p.batch_for_tokens(tc.global_batch_tokens)
        line += (f"\nfor trainer.global_batch_tokens={tc.global_batch_tokens}: the largest "
                 f"per-rank batch that fits is data.batch_per_dp_rank={fit_b} with "
                 f"trainer.grad_accum_steps={fit_k} (peak {size(peak)} per rank)")
    except ValueError as e:
        line += f"\nfor trainer.global_batch_tokens={tc.global_batch_tokens}: {e}"
    return line
