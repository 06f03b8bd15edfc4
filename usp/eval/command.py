"""How ``usp-eval`` starts its ranks, as ``usp-train`` does: ``trainer.nprocs`` local
ranks (``usp.launch.run_local``), or the tasks torchrun/Slurm started, which meet in the
rendezvous store before any process group so that a refusal is said once."""

from __future__ import annotations

import gc

import torch
import torch.distributed as dist

from ..config import RunConfig
from ..launch import (choose_device, decide_together, init_from_env, launcher_env,
                      rendezvous_store, run_local)
from ..run import resolve_eval
from .job import plan_eval
from .runner import run_eval


def _decide(cfg: RunConfig, world: int, device: str, out: str | None):
    """(EvalJob, RunLayout): every bad input refused here, before any process group; the
    planner's table (forward-only memory) printed when it chose a degree."""
    job = plan_eval(cfg, out)
    return job, resolve_eval(job.cfg, world, device, job.lengths,
                             say=lambda text: print(text, flush=True))


def _device(run) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if run.device == "cuda" \
        else torch.device("cpu")


def _worker(job, run) -> None:
    run_eval(job, run, dist.get_rank(), _device(run))


def evaluate(cfg: RunConfig, out: str | None = None) -> int:
    """Run ``usp-eval`` on ``cfg`` (``cfg.eval``); ``out``: the Hydra run directory, used
    when neither ``eval.out`` nor ``eval.run_dir`` is given. Returns the exit code."""
    tc = cfg.trainer
    info = launcher_env()
    if info is None:
        _, device = choose_device(tc.device, tc.nprocs, torch.cuda.is_available(),
                                  torch.cuda.device_count())
        job, run = _decide(cfg, tc.nprocs, device, out)
        return run_local(_worker, tc.nprocs, job, run, device_type=run.device,
                         timeout_s=tc.timeout_s)

    def decide():
        _, device = choose_device(tc.device, 1, torch.cuda.is_available(),
                                  torch.cuda.device_count())
        return _decide(cfg, info["world"], device, out)

    store = rendezvous_store(info, tc.timeout_s)
    job, run = decide_together(store, info, decide, lambda decided: None, tc.timeout_s)
    init_from_env(info, run.device, timeout_s=tc.timeout_s, store=store)
    try:
        _worker(job, run)
    finally:
        gc.collect()
        dist.destroy_process_group()
    return 0
