"""The run's decisions: the balance (``parallel.balance``, ``auto`` resolved), the degrees
(fixed, or the planner's choice on the detected cluster) and the all-to-all pipeline
stages, the expert degree, the loss chunk and MLP tiles (``auto``: sized by the planner for
the decided layout, ``usp.planner.tiles``). The accumulation is the planner's
``grad_accum_steps``; ``resolve.resolve_run`` takes them in that order."""

from __future__ import annotations

import os
from dataclasses import replace

from ..config import ModelConfig, RunConfig
from ..models.families import check_priced
from ..dims.balance import choose_balance, sequence_balance
from ..planner import detect_topology
from ..planner.cost import choose_a2a_chunks
from ..planner.report import config_degree, plan_run, plan_table, run_step
from ..planner.tiles import tile_note
from ..rules import check_degrees, check_expert_degree
from .preflight import check_degrees_fit


def _simulated_nodes(spec, ranks_per_node: int | None, world: int):
    """``spec`` as nodes of ``parallel.ranks_per_node`` ranks (simulated on one machine),
    or unchanged when that is unset."""
    if not ranks_per_node:
        return spec
    return spec.replace(ranks_per_node=ranks_per_node, nodes=world // ranks_per_node)


def detected_cluster(cfg: RunConfig, world: int, ranks_per_node: int | None, env=None):
    """(cluster spec, ``DetectReport``) the planner sees: the config's spec, sized to
    ``world``, with the topology the launcher and this machine report (``detect_topology``),
    as nodes of ``ranks_per_node`` ranks when those are simulated (None: real hosts)."""
    spec, report = detect_topology(os.environ if env is None else env, spec=cfg.cluster)
    if ranks_per_node:
        spec = _simulated_nodes(spec, ranks_per_node, world)
    elif spec.world != world:
        spec = spec.replace(nodes=max(1, world // spec.ranks_per_node))
    return spec, report


def decide_balance(cfg: RunConfig) -> tuple[str, str]:
    """(the run's balance, why; ``usp.dims.balance.choose_balance``): ``parallel.balance``
    with ``auto`` resolved, ``per_document`` when ``data.packing=documents`` packs documents
    under the document mask on usp's ring, else ``zigzag``; an explicit ``per_document``
    without packed documents or with another ring engine is refused."""
    return choose_balance(cfg.parallel.balance, cfg.data.packed, cfg.parallel.ring_impl)


def decide_eval_balance(cfg: RunConfig) -> str:
    """usp-eval's balance: its rows (passkey cases, position-loss windows) are one sequence
    each, with no document mask, so ``auto`` and ``per_document`` lay them out as zigzag
    (``sequence_balance``); a set ``zigzag`` or ``contiguous`` is kept."""
    pc = cfg.parallel
    return sequence_balance("zigzag" if pc.balance == "auto" else pc.balance)


def decide_degrees(cfg: RunConfig, world: int, env=None, topology=None,
                   forward_only: bool = False,
                   balance: str | None = None) -> tuple[int, int, int, str]:
    """(ulysses, ring, dp, the planner's table or ""): fixed degrees pass through; ``auto``
    asks the planner on the detected cluster (``topology()``: ``detected_cluster``'s answer,
    default detected here from ``env``), its memory forward-only for usp-eval
    (``forward_only``), priced with the run's ``balance`` (None: ``decide_balance``'s). The degrees
    are checked against the world, the heads and the sequence (``check_degrees_fit``)
    before they are returned."""
    pc = cfg.parallel
    balance = decide_balance(cfg)[0] if balance is None else balance
    u = config_degree(pc.ulysses_degree, "ulysses_degree")
    r = config_degree(pc.ring_degree, "ring_degree")
    table = ""
    if u is None or r is None:
        check_priced(cfg.model, "parallel.ulysses_degree/ring_degree=auto")
        spec, report = (topology() if topology else
                        detected_cluster(cfg, world, pc.ranks_per_node, env))
        p = plan_run(cfg, spec, world, forward_only, balance=balance)
        u, r = p.best.ulysses, p.best.ring
        table = plan_table(report, p)
    dp = check_degrees(world, u, r, config_degree(pc.dp_degree, "dp_degree"))
    check_degrees_fit(cfg, u, r, balance)
    return u, r, dp, table


def decide_expert_degree(cfg: RunConfig, world: int, ulysses: int = 1, ring: int = 1,
                         dp: int | None = None, topology=None,
                         balance: str | None = None) -> int:
    """The run's expert degree (``parallel.expert_degree``): a number checked against the
    ranks and the experts (``usp.rules.check_expert_degree``); ``auto``: 1 for a model whose
    experts are transformers' or that has none, else the planner's fastest expert degree for
    the decided ``(dp, ring, ulysses)`` on the detected cluster (``topology()``: as
    ``decide_degrees``; ``balance``: the run's, None: ``decide_balance``'s)."""
    pc, mc = cfg.parallel, cfg.model
    degree = config_degree(pc.expert_degree, "expert_degree")
    if degree is not None:
        check_expert_degree(degree, world, mc.n_experts, mc.hf)
        return degree
    if mc.n_experts is None or mc.hf is not None:
        return 1
    balance = decide_balance(cfg)[0] if balance is None else balance
    spec, _ = topology() if topology else detected_cluster(cfg, world, pc.ranks_per_node)
    fixed = replace(cfg, parallel=replace(pc, ulysses_degree=ulysses, ring_degree=ring,
                                          dp_degree=dp))
    return plan_run(fixed, spec, world, balance=balance).best.expert


def decide_a2a_chunks(cfg: RunConfig, world: int, ulysses: int, ring: int, dp: int,
                      ranks_per_node: int | None, topology, balance: str) -> int:
    """``parallel.a2a_chunks`` as an int, by the planner's rule (``choose_a2a_chunks``: an
    int checked against the heads; ``auto``: 1 when the ulysses group stays inside a node,
    else priced on the spec). The nodes: ``ranks_per_node`` (simulated), else what the
    launcher or the hardware reports; when nothing reports nodes, the ranks are this
    launch's processes on one host, as ``SPMesh`` will find them. usp's own ring only.
    ``topology()``: ``detected_cluster``'s answer, asked only when ``auto`` needs it;
    ``balance``: the run's (``decide_balance``); per_document pipelines nothing (1)."""
    pc, m = cfg.parallel, cfg.model
    if pc.ring_impl != "usp":
        if pc.a2a_chunks == "auto":
            return 1
        if pc.a2a_chunks > 1:
            raise ValueError(f"parallel.a2a_chunks={pc.a2a_chunks} pipelines usp's own ring; "
                             f"use parallel.ring_impl=usp or parallel.a2a_chunks=1")
    if balance == "per_document":  # the ring runs row by row, between whole all-to-alls
        if pc.a2a_chunks == "auto":
            return 1
        if pc.a2a_chunks > 1:
            raise ValueError(f"parallel.a2a_chunks={pc.a2a_chunks} pipelines the ulysses "
                             f"all-to-alls around one ring pass, but balance per_document "
                             f"runs a ring pass per row; use parallel.a2a_chunks=1 (or auto), "
                             f"or parallel.balance=zigzag")
    if pc.a2a_chunks == "auto" and ulysses == 1:
        return 1  # no all-to-all to pipeline: nothing to detect
    spec = cfg.cluster
    if pc.a2a_chunks == "auto":
        spec, report = topology()
        if not ranks_per_node and "ranks_per_node" not in report.detected:
            spec = spec.replace(ranks_per_node=world, nodes=1)  # local processes, one host
    return choose_a2a_chunks(pc.a2a_chunks, spec, cfg.data.seq_len, m.n_heads, m.n_kv_heads,
                             m.head_dim, ulysses, ring, dp=dp,
                             dtype_bytes=cfg.trainer.compute_dtype.itemsize,
                             balance=balance, placement=pc.placement,
                             n_fwd=2 if cfg.trainer.activation_checkpointing else 1)


def decide_tiles(cfg: RunConfig, ulysses: int, ring: int, topology, expert: int = 1,
                 forward_only: bool = False) -> tuple[ModelConfig, str | None]:
    """(``cfg.model`` with ``model.loss_chunk`` and ``model.mlp_tiles`` as numbers, the start
    line that says what ``auto`` picked or None): an ``auto`` one sized by the planner
    (``usp.planner.tiles``) for ``data.batch_per_dp_rank`` sequences of ``data.seq_len`` on ``ring x ulysses`` at expert degree ``expert``, against the budget
    of the detected cluster (``topology()``, as ``decide_degrees``: on a CPU run the cluster
    spec's ``mem_bytes``), priced forward-only for usp-eval (``forward_only``). A
    transformers model (``model.hf``) has no tilings to size: refused by name."""
    mc = cfg.model
    if not mc.planned:
        return mc, None
    if mc.hf is not None:
        raise ValueError(f"model.{mc.planned[0]}=auto sizes the built-in model's chunked loss "
                         f"and tiled MLP and norms, but model.hf={mc.hf} computes its own LM "
                         "head, MLP and norms, which the planner cannot size; set "
                         "model.loss_chunk=0 model.mlp_tiles=1 model.norm_tiles=1, or "
                         "model.hf=null for the built-in model")
    step = run_step(cfg, forward_only)
    choice = step.sized(mc, cfg.data.seq_len, ring, ulysses, cfg.data.batch_per_dp_rank,
                        expert, step.budget(topology()[0]))
    return choice.model, tile_note(mc, choice)
