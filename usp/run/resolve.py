"""The resolver: the config and the launcher's world -> one ``RunLayout``, every rule run."""

from __future__ import annotations

from dataclasses import replace
from functools import cache, partial

import torch.distributed as dist

from ..config import RunConfig
from ..data.dataset import loss_notes
from ..models.pretrained import start_notes
from ..planner.batch import grad_accum_steps
from ..rules import check_ranks_per_node, check_seq_len
from .decide import (decide_a2a_chunks, decide_balance, decide_degrees, decide_eval_balance,
                     decide_expert_degree, decide_tiles, detected_cluster)
from .run_layout import RunLayout
from .preflight import check_inputs, check_passkey_memory, check_task


def _silent(text: str) -> None:
    """``say`` that says nothing."""


_print = partial(print, flush=True)


def resolve_run(cfg: RunConfig, world: int, device: str, env=None, *,
                scheduler_hosts: bool = False, run_dir: str | None = None,
                say=_silent) -> RunLayout:
    """The run's layout for ``world`` ranks computing on ``device`` ("cpu" or "cuda", the
    launcher's ``choose_device``), after every rule; raises ``ValueError``.

    In order: every input check once (the world's nodes, ``check_inputs``), then the
    decisions (balance; degrees, checked against the heads and the sequence; all-to-all
    stages; accumulation), then the layout. ``env``: the launcher's variables for topology
    detection (default ``os.environ``), read when a degree or ``parallel.a2a_chunks`` is
    ``auto`` (the latter by default). ``scheduler_hosts``: the ranks run on the hosts a
    scheduler (Slurm) gave them, which place them; a configured ``parallel.ranks_per_node``
    (simulated nodes) is then not used. ``run_dir``: where the run writes when
    ``trainer.run_dir`` is not set (the launcher's folder, e.g. Hydra's output folder).
    ``say(text)``: the balance and why, what an ``auto`` loss chunk or MLP tiling was sized
    to (``decide_tiles``), and the planner's table once the layout stands when it chose a
    degree. The layout carries the tilings as numbers (``RunLayout.model_config``)."""
    pc = cfg.parallel
    run_dir = cfg.trainer.run_dir or run_dir  # None: a layout to plan with, not to train
    ranks_per_node = None if scheduler_hosts else pc.ranks_per_node
    check_ranks_per_node(world, ranks_per_node, "parallel.ranks_per_node")
    check_inputs(cfg, device, run_dir)
    for line in start_notes(cfg.model, cfg.data.seq_len):  # model.pretrained: rope changes
        say(f"usp: {line}")
    for line in loss_notes(cfg.data):  # token files with a loss mask
        say(f"usp: {line}")
    balance, why = decide_balance(cfg)
    say(f"usp: balance {balance} ({why})")
    # detected at most once, and only when an auto setting asks
    topology = cache(partial(detected_cluster, cfg, world, ranks_per_node, env))
    u, r, dp, table = decide_degrees(cfg, world, env, topology, balance=balance)
    chunks = decide_a2a_chunks(cfg, world, u, r, dp, ranks_per_node, topology, balance)
    accum = grad_accum_steps(cfg.trainer, cfg.data.seq_len, cfg.data.batch_per_dp_rank, dp)
    experts = decide_expert_degree(cfg, world, u, r, dp, topology, balance)
    model, tiles = decide_tiles(cfg, u, r, topology, experts)
    cfg = replace(cfg, model=model)  # the tilings as numbers from here on
    check_passkey_memory(cfg, dp, r, u, device, balance)
    for note in (tiles, router_loss_note(cfg.model, accum, experts)):
        if note:
            say(f"usp: {note}")
    layout = RunLayout(world=world, dp=dp, ring=r, ulysses=u, placement=pc.placement,
                       ranks_per_node=ranks_per_node, balance=balance, kernel=pc.kernel,
                       ring_impl=pc.ring_impl, a2a_chunks=chunks, device=device,
                       dtype=cfg.trainer.dtype, seq_len=cfg.data.seq_len,
                       batch_per_dp_rank=cfg.data.batch_per_dp_rank, grad_accum=accum,
                       run_dir=None if run_dir is None else str(run_dir), expert_degree=experts,
                       loss_chunk=model.loss_chunk, mlp_tiles=model.mlp_tiles,
                     norm_tiles=model.norm_tiles)
    if table:
        say(table)
    return layout


def router_loss_note(mc, accum: int, experts: int) -> str | None:
    """The start line of a mixture of experts: its expert degree and router loss (weight,
    whose tokens pool, and per micro-batch when a step has several); None for a dense
    model."""
    if mc.n_experts is None:
        return None
    loss = "no router loss (model.router_aux_loss_coef=0)"
    if mc.router_aux_loss_coef:
        over = "the batch of each dp rank" if mc.router_balance_over == "sp" else \
            "the global batch"
        loss = f"router loss x {mc.router_aux_loss_coef:g} pooled over {over}"
        if accum > 1:
            loss += (f", formed per micro-batch ({accum} a step) and averaged: later "
                     "micro-batches' routing is not known in an earlier one's backward")
    return f"{mc.n_experts} experts a sparse layer, expert degree {experts}; {loss}"


def resolve_run_group(cfg: RunConfig, device_type: str, env=None, say=_print) -> RunLayout:
    """``resolve_run`` for ranks started by torchrun/Slurm (collective).

    Rank 0 resolves (and alone reads its launcher variables and hardware for ``auto``);
    every rank receives rank 0's layout and checks its own task (``check_task``). A refusal
    on any rank is raised on every rank (none is left waiting in a collective). Once every
    rank agreed, rank 0 says the planner's table (``say``), when the planner chose."""
    return decide_in_group(
        lambda world, said: resolve_run(cfg, world, device_type, env, say=said),
        lambda layout: check_task(cfg, layout), say)


def decide_in_group(resolve, check, say):
    """The collective protocol of ``resolve_run_group``: rank 0 runs ``resolve(world,
    say)``, every rank receives its value and the others run ``check(value)``; a refusal
    on any rank is raised on every rank; then rank 0's words go to ``say``."""
    rank, world = dist.get_rank(), dist.get_world_size()
    value, error, said = None, None, []
    if rank == 0:
        try:
            value = resolve(world, said.append)
        except (ValueError, FileNotFoundError) as e:
            error = str(e)
    decided = [(value, error)]
    dist.broadcast_object_list(decided, src=0)  # every rank now holds rank 0's decision
    value, error = decided[0]
    if error is None and rank != 0:
        try:
            check(value)
        except (ValueError, FileNotFoundError) as e:
            error = f"rank {rank}: {e}"
    errors = [None] * world
    dist.all_gather_object(errors, error)
    refused = [e for e in errors if e is not None]
    if refused:
        raise ValueError(refused[0])
    for text in said:
        say(text)
    return value


def scheduler_hosts_notice(cfg: RunConfig, placement: str) -> str | None:
    """Under a scheduler (Slurm) the job's real hosts place the ranks
    (``resolve_run(..., scheduler_hosts=True)``): the line that says a configured
    ``parallel.ranks_per_node`` (a recipe's simulated nodes, e.g. ``tiny_cpu``) is not
    used, or None when none was set."""
    if not cfg.parallel.ranks_per_node:
        return None
    return (f"parallel.ranks_per_node={cfg.parallel.ranks_per_node} ignored under Slurm: the "
            f"mesh uses the job's hosts ({placement})")


def resolve_eval(cfg: RunConfig, world: int, device: str, lengths: list[int], env=None,
                 say=_silent) -> RunLayout:
    """``usp-eval``'s layout for ``world`` ranks at the longest of ``lengths``: ``auto``
    degrees planned there with the planner's forward-only memory (no gradients, no optimizer
    state, the model whole on every rank) for the rows one forward pass holds (a passkey
    cell's ``eval.per_cell``, or ``eval.windows`` position-loss windows), every length
    checked against it (``check_seq_len``); one sample a row, one sequence with no document
    mask, so ``auto`` lays it out as zigzag (``decide_eval_balance``). ``say(text)``: the
    planner's table when it chose a degree. The data's own checks are ``usp.eval.job``'s."""
    ec = cfg.eval
    rows = max(ec.per_cell if ec.passkey else 1, ec.windows if ec.position_loss else 1)
    longest = replace(cfg, data=replace(cfg.data, seq_len=max(lengths), batch_per_dp_rank=rows))
    pc = cfg.parallel
    check_ranks_per_node(world, pc.ranks_per_node, "parallel.ranks_per_node")
    topology = cache(partial(detected_cluster, longest, world, pc.ranks_per_node, env))
    balance = decide_eval_balance(cfg)
    u, r, dp, table = decide_degrees(longest, world, env, topology, forward_only=True,
                                     balance=balance)
    for length in lengths:
        check_seq_len(length, u, r, balance)
    chunks = decide_a2a_chunks(longest, world, u, r, dp, pc.ranks_per_node, topology, balance)
    model, tiles = decide_tiles(longest, u, r, topology, forward_only=True)
    for line in (f"usp: {tiles}" if tiles else "", table):
        if line:
            say(line)
    return RunLayout(world=world, dp=dp, ring=r, ulysses=u, placement=pc.placement,
                     ranks_per_node=pc.ranks_per_node, balance=balance, kernel=pc.kernel,
                     ring_impl=pc.ring_impl, a2a_chunks=chunks, device=device,
                     dtype=cfg.trainer.dtype, seq_len=max(lengths), batch_per_dp_rank=1,
                     loss_chunk=model.loss_chunk, mlp_tiles=model.mlp_tiles,
                     norm_tiles=model.norm_tiles)
