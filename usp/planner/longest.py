"""``usp-plan ... longest=true``: the longest sequence the given GPUs train, over every layout
the config allows, with every memory feature it asks for (an ``auto`` ``loss_chunk`` /
``mlp_tiles`` re-sized at each length tried), and what the step looks like there: the
layout, the memory terms (every term ``memory_split`` prices), the modelled step time."""

from __future__ import annotations

from dataclasses import replace

from ..config import PlanConfig
from ..dims import work
from ..dims.heads import head_split
from ..rules import seq_multiple
from .fit import longest_seq_len
from .memory import size
from .options import BatchSpec
from .plan import plan
from .ranking import tiles_text
from .report import run_search, run_step

SHOWN = 5  # layouts listed beside the longest


def features_text(cfg: PlanConfig) -> str:
    """The memory features the config asks for, as ``usp-plan`` prices them."""
    tc, m = cfg.trainer, cfg.model
    ckpt = (f"activation checkpointing ({tc.checkpoint_part}, every {tc.checkpoint_every})"
            if tc.activation_checkpointing else "no activation checkpointing")
    parts = [ckpt + (" offloaded to host memory" if tc.activation_offload else ""),
             "sharded state in host memory" if tc.state_offload else "sharded state on the GPU",
             f"loss_chunk {m.loss_chunk}", f"mlp_tiles {m.mlp_tiles}",
             f"norm_tiles {m.norm_tiles}", f"dtype {tc.dtype}",
             "FSDP over every rank, AdamW"]
    return "features: " + ", ".join(parts)


def longest_report(cfg: PlanConfig) -> str:
    """usp-plan's answer in longest mode (module docstring): of the layouts that hold the
    longest sequence, the fastest by the model; ValueError when none holds its shortest."""
    spec = cfg.cluster if cfg.nodes is None else cfg.cluster.replace(nodes=cfg.nodes)
    world, search, step = spec.world, run_search(cfg), run_step(cfg)
    found = layout_longest(cfg, spec, world)
    n = found[0][0] if found else 0
    if not n:
        peak = step.memory(cfg.model, 2, world, 1, 1, cfg.data.batch_per_dp_rank,
                           budget=step.budget(spec))
        raise ValueError(f"no layout of {world} GPUs of cluster {spec.name} holds even its "
                         f"shortest sequence: the state alone is {size(peak.state)} a GPU > "
                         f"{size(step.budget(spec))}; use more GPUs or GPUs with more memory "
                         "(cluster.mem_bytes)")
    plans = [plan(cfg.model, spec, n, world=world, search=replace(search, dp=d, ring=r, ulysses=u),
                  batch=BatchSpec(per_dp_rank=cfg.data.batch_per_dp_rank), step=step)
             for m, (d, r, u) in found if m == n]
    p = min(plans, key=lambda q: q.best.seq_s)  # the fastest of those that hold n
    c = p.best
    more = n + seq_multiple(c.ulysses, c.ring, search.balance)
    beyond = step.memory(cfg.model, more, c.dp, c.ring, c.ulysses, c.batch, c.expert, p.budget)
    tokens_s = c.global_batch * n / c.cost.step_s
    lines = [(f"longest sequence on {world} GPUs ({spec.nodes} x {spec.ranks_per_node} of "
              f"{spec.name}, {size(p.budget)} a GPU): {n} tokens on {c.label()}"),
             features_text(cfg),
             f"memory per rank at {n}, peak at {c.memory.peak_at}:",
             f"  {c.memory.line(p.budget)}",
             p.host_text(c).rstrip("\n"),
             tiles_text(cfg.model, c.model).rstrip("\n"),
             split_text(c.model, n, c.ring, c.ulysses, cfg.trainer.compute_dtype.itemsize),
             (f"modelled step time: {c.cost.step_s:.1f} s a step of {c.global_batch} "
              f"sequence(s) ({tokens_s:,.0f} tokens/s)"),
             (f"one step longer ({more}) peaks at {beyond.total / 2**30:.4f} GiB > "
              f"{p.budget / 2**30:.4f} GiB"),
             "longest by layout:"]
    lines += [f"  ulysses {u} x ring {r} x dp {d}: {m}" for m, (d, r, u) in found[:SHOWN]]
    return "\n".join(line for line in lines if line)


def split_text(model, seq_len: int, ring: int, ulysses: int, dtype_bytes: int) -> str:
    """What ``usp.dims.work`` splits by size at this length: a block norm's sequence tiles
    and the attention backward's head groups a call."""
    T, S = seq_len / (ring * ulysses), seq_len / ring
    split = head_split(model.n_heads, model.n_kv_heads, ulysses)
    norms = work.norm_tiles(model.norm_tiles, T, model.dim)
    calls = max(len(work.backward_head_groups(S, S, qc, kc, model.head_dim, dtype_bytes))
                for qc, kc in zip(split.q_counts, split.kv_counts))
    return (f"  split by size (usp.dims.work): a block norm in {norms} tile(s), each attention "
            f"backward call in {calls} head group(s)")


def layout_longest(cfg: PlanConfig, spec, world: int) -> list[tuple[int, tuple[int, int, int]]]:
    """(the longest sequence, (dp, ring, ulysses)) of every layout of ``world`` ranks the
    config allows whose heads split, longest first."""
    step, search = run_step(cfg), run_search(cfg)
    found = []
    for d, r, u in search.layouts(world):
        try:
            n = longest_seq_len(cfg.model, step.budget(spec), d, r, u, step,
                                balance=search.balance, batch=cfg.data.batch_per_dp_rank,
                                cluster=spec)
        except ValueError:  # heads that do not split over u
            continue
        found.append((n, (d, r, u)))
    return sorted(found, key=lambda f: -f[0])
