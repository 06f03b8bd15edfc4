"""The resolver: the config and the launcher's world -> one ``RunLayout``, every rule run."""

from __future__ import annotations

from functools import cache, partial

import torch
import torch.distributed as dist

from ..config import RunConfig
from ..ulysses import check_heads
from ..validate import check_placement, check_ranks_per_node
from .decide import _a2a_chunks, _cluster, decide_degrees
from ..planner.batch import grad_accum_steps
from .layout import RunLayout
from .preflight import check_task


def resolve_run(cfg: RunConfig, world: int, device_type: str | None = None,
                env=None) -> RunLayout:
    """The run's layout for ``world`` ranks computing on ``device_type`` ("cpu" or "cuda";
    None: cuda when this process sees a GPU), after every rule; raises ``ValueError``.

    ``env``: the launcher's variables for topology detection (default ``os.environ``),
    read when a degree or ``parallel.a2a_chunks`` is ``auto`` (the latter by default)."""
    pc = cfg.parallel
    topology = cache(partial(_cluster, cfg, world, env))  # detected at most once, if asked
    u, r, dp, table = decide_degrees(cfg, world, env, topology)
    check_ranks_per_node(world, pc.ranks_per_node, "parallel.ranks_per_node")
    check_placement(pc.placement)
    check_heads(cfg.model.n_heads, cfg.model.n_kv_heads, u)
    chunks = _a2a_chunks(cfg, world, u, r, dp, topology)  # check_task checks the sequence
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    accum = grad_accum_steps(cfg.trainer, cfg.data.seq_len, cfg.data.batch_per_dp_rank, dp)
    layout = RunLayout(world=world, dp=dp, ring=r, ulysses=u, placement=pc.placement,
                       ranks_per_node=pc.ranks_per_node, balance=pc.balance, kernel=pc.kernel,
                       ring_impl=pc.ring_impl, a2a_chunks=chunks, device=device_type,
                       dtype=cfg.trainer.dtype, seq_len=cfg.data.seq_len,
                       batch_per_dp_rank=cfg.data.batch_per_dp_rank, plan_table=table,
                       grad_accum=accum)
    check_task(cfg, layout)
    return layout



def resolve_run_group(cfg: RunConfig, device_type: str, env=None) -> RunLayout:
    """``resolve_run`` for ranks started by torchrun/Slurm (collective).

    Rank 0 resolves (and alone reads its launcher variables and hardware for ``auto``);
    every rank receives rank 0's layout and checks its own task (``check_task``). A refusal
    on any rank is raised on every rank (none is left waiting in a collective)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    layout, error = None, None
    if rank == 0:
        try:
            layout = resolve_run(cfg, world, device_type, env)
        except (ValueError, FileNotFoundError) as e:
            error = str(e)
    decided = [(layout, error)]
    dist.broadcast_object_list(decided, src=0)  # every rank now holds rank 0's decision
    layout, error = decided[0]
    if error is None and rank != 0:
        try:
            check_task(cfg, layout)
        except (ValueError, FileNotFoundError) as e:
            error = f"rank {rank}: {e}"
    errors = [None] * world
    dist.all_gather_object(errors, error)
    refused = [e for e in errors if e is not None]
    if refused:
        raise ValueError(refused[0])
    return layout


def use_scheduler_hosts(cfg: RunConfig, placement: str) -> str | None:
    """Under a scheduler (Slurm) the job's real hosts place the ranks: a configured
    ``parallel.ranks_per_node`` (a recipe's simulated nodes, e.g. ``tiny_cpu``) is dropped.
    Returns the line that says so, or None when none was set."""
    if not cfg.parallel.ranks_per_node:
        return None
    dropped, cfg.parallel.ranks_per_node = cfg.parallel.ranks_per_node, None
    return (f"parallel.ranks_per_node={dropped} ignored under Slurm: the mesh uses the job's "
            f"hosts ({placement})")
