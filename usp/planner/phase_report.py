"""The planner on a run of length phases (``trainer.phases``): ``usp-plan``'s report of every
phase, where memory or heads force a change of layout, and the words of a phase that no
layout of the world fits (the longest length that fits, the ranks that would fit it)."""

from __future__ import annotations

from ..config import PlanConfig, RunConfig, phase_config
from ..config.phases import phase_heading, steps_for_tokens
from ..dims.heads import check_heads
from .batch import grad_accum_steps
from .draw import draw_mesh
from .fit import longest_seq_len
from .memory import size
from .ranking import Candidate, Plan
from .report import global_batch_text, plan_run, run_search, run_step

MOST_NODES = 1024  # nodes tried when saying how many would fit a phase


def longest_fit(cfg: RunConfig, spec, world: int) -> tuple[int, tuple[int, int, int] | None]:
    """(the longest sequence some layout of ``world`` ranks on ``spec`` fits by the planner's
    memory, with the run's fixed degrees, heads and features; that layout as (dp, ring,
    ulysses), None when not even the shortest fits)."""
    step, search, mc = run_step(cfg), run_search(cfg), cfg.model
    best: tuple[int, tuple[int, int, int] | None] = (0, None)
    for d, r, u in search.layouts(world):
        try:
            check_heads(mc.n_heads, mc.n_kv_heads, u)
        except ValueError:
            continue
        n = longest_seq_len(mc, step.budget(spec), d, r, u, step, balance=search.balance,
                            batch=cfg.data.batch_per_dp_rank)
        if n > best[0]:
            best = (n, (d, r, u))
    return best


def nodes_to_fit(cfg: RunConfig, spec) -> int | None:
    """The fewest nodes of ``spec`` (doubling from its own) on which some layout fits
    ``cfg``'s sequence, or None up to ``MOST_NODES``."""
    nodes = spec.nodes
    while nodes < MOST_NODES:
        nodes *= 2
        bigger = spec.replace(nodes=nodes)
        try:
            plan_run(cfg, bigger, bigger.world)
        except ValueError:
            continue
        return nodes
    return None


def unfit_text(cfg: RunConfig, spec, world: int) -> str:
    """What fits instead of ``cfg``'s sequence on ``world`` ranks of ``spec``: the longest
    length and its layout, and the nodes that would fit this one."""
    most, layout = longest_fit(cfg, spec, world)
    if layout is None:
        text = f"no layout of {world} ranks fits even the shortest sequence"
    else:
        d, r, u = layout
        text = (f"the longest length {world} ranks fit is {most} (dp {d} x ring {r} x ulysses "
                f"{u})")
    nodes = nodes_to_fit(cfg, spec)
    if nodes is not None:
        text += (f"; {cfg.data.seq_len} fits {nodes} nodes of {spec.ranks_per_node} "
                 f"({nodes * spec.ranks_per_node} ranks)")
    return text + ("; or lower its memory: model.loss_chunk, model.mlp_tiles, "
                   "trainer.activation_checkpointing=true, a smaller data.batch_per_dp_rank")


def memory_refused(text: str) -> bool:
    """Whether ``plan``'s refusal ``text`` (no feasible layout) counts layouts refused for
    memory, so that a longer world or less memory per token would help."""
    return text.startswith("no feasible layout") and "memory refused" in text


def phase_refused(k: int, cfg: RunConfig, text: str, spec, world: int) -> ValueError:
    """Phase ``k``'s layout refused with ``text`` (``cfg``: the phase's config): the error
    naming ``trainer.phases[k]`` and its length, and when memory refused layouts, what would
    fit on ``world`` ranks (``unfit_text`` on ``spec()``, the cluster, asked only then)."""
    if memory_refused(text):
        text += f"; {unfit_text(cfg, spec(), world)}"
    return ValueError(f"trainer.phases[{k}] (seq_len {cfg.data.seq_len}): {text}")


def phase_steps(cfg: RunConfig, k: int, tokens_per_step: int, why: str) -> int:
    """Phase ``k``'s planned steps: its ``steps``, or its ``tokens`` in steps of
    ``tokens_per_step`` (``why``: how a step's tokens come about)."""
    p = cfg.trainer.phases[k]
    return p.steps if p.steps is not None else steps_for_tokens(k, p.tokens, tokens_per_step,
                                                                 why)


def step_tokens_text(L: int, b: int, dp: int, k: int) -> str:
    """How one optimizer step's tokens come about, for messages."""
    return f"seq_len {L} x batch_per_dp_rank {b} x dp {dp} x grad_accum_steps {k}"


def change_text(k: int, p: Plan, before: Candidate) -> str | None:
    """Phase ``k``'s (0-based) layout against phase ``k - 1``'s choice ``before``: why it
    changes (no longer fits, by memory or heads; or a faster one), None when it stays."""
    best = p.best
    if best.degrees == before.degrees:
        return None
    head = f"phase {k + 1} ({p.seq_len}): {before.label()} of phase {k}"
    kept = p.find(*before.degrees)
    if kept is not None:
        return (f"{head} still fits (peak {size(kept.memory.total)}); {best.label()} is "
                f"{1 - best.seq_s / kept.seq_s:.1%} faster per sequence")
    dropped = next((d for d in p.dropped if (d.dp, d.ring, d.ulysses) == before.degrees), None)
    if dropped is not None and dropped.rule == "memory":
        peak = p.step.memory(p.model, p.seq_len, *before.degrees, p.batch.for_dp(before.dp),
                             budget=p.budget)
        why = f"peak {size(peak.total)} > {size(p.budget)}"
    elif dropped is not None and dropped.rule == "batch" and p.batch.step_sequences:
        why = (f"trainer.global_batch_tokens is {p.batch.step_sequences:g} sequences a step, "
               f"no whole number of micro-batches of dp {before.dp}")
    elif dropped is not None:
        why = f"{dropped.rule}: {dropped.reason}"
    else:
        why = "not among the layouts searched"
    return f"{head} no longer fits ({why}); {best.label()} chosen"


def phases_report(cfg: PlanConfig) -> tuple[str, object]:
    """usp-plan's answer for a run with ``trainer.phases``: each phase's heading and plan
    (table, choice, global batch, memory), the changes of layout between phases, and a
    summary table; the mesh drawing of the last phase."""
    spec = cfg.cluster if cfg.nodes is None else cfg.cluster.replace(nodes=cfg.nodes)
    world, n = spec.world, len(cfg.trainer.phases)
    out, rows, changes, before, at = [], [], [], None, 0
    for k, entry in enumerate(cfg.trainer.phases):
        pcfg = phase_config(cfg, k)
        L, b = pcfg.data.seq_len, pcfg.data.batch_per_dp_rank
        try:
            p = plan_run(pcfg, spec, world, cfg.forward_only)
        except ValueError as e:
            raise phase_refused(k, pcfg, str(e), lambda: spec, world) from None
        best = p.best
        try:
            accum = grad_accum_steps(pcfg.trainer, L, b, best.dp)
            tokens = L * b * best.dp * accum
            steps = phase_steps(cfg, k, tokens, step_tokens_text(L, b, best.dp, accum))
        except ValueError as e:
            raise ValueError(f"trainer.phases[{k}] (seq_len {L}) on dp {best.dp} x ring "
                             f"{best.ring} x ulysses {best.ulysses}: {e}") from None
        out.append(phase_heading(k, n, L, at + 1, at + steps, pcfg.model, entry.lr, entry.until,
                                 blend=entry.blend))
        out += [p.format_table(),
                f"choice: dp {best.dp} x ring {best.ring} x ulysses {best.ulysses}",
                global_batch_text(pcfg, p), p.memory_text(), ""]
        if before is not None:
            line = change_text(k, p, before)
            if line:
                changes.append(line)
        rows.append((k + 1, L, best, accum, tokens, steps, pcfg.model.rope_theta))
        before, at = best, at + steps
    out.append(f"phases on world {world} ({spec.nodes} x {spec.ranks_per_node} on {spec.name}), "
               f"trainer.steps {at} = {' + '.join(str(r[5]) for r in rows)}:")
    out.append(f"{'phase':>5} {'seq_len':>8} {'dp':>3} {'ring':>4} {'ulysses':>7} {'K':>3} "
               f"{'tokens/step':>11} {'steps':>6} {'mem/rank':>9} {'rope_theta':>10}")
    for i, L, c, accum, tokens, steps, theta in rows:
        out.append(f"{i:>5} {L:>8} {c.dp:>3} {c.ring:>4} {c.ulysses:>7} {accum:>3} {tokens:>11} "
                   f"{steps:>6} {size(c.memory.total):>9} {theta:>10.10g}")
    out += changes or ["the same layout in every phase"]
    last = rows[-1][2]
    drawing = draw_mesh(last.dp, last.ring, last.ulysses, spec.ranks_per_node,
                        p.search.placement)
    out.append(str(drawing))
    return "\n".join(out), drawing
