"""How ``usp-eval`` starts its ranks, as ``usp-train`` does (``usp.launch.job``):
``trainer.nprocs`` local ranks, or the tasks torchrun/Slurm started, which meet in the
rendezvous store before any process group so that a refusal is said once."""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist

from ..config import RunConfig
from ..launch.job import prepare, start
from ..run import resolve_eval
from .job import plan_eval
from .runner import run_eval


def _decide(cfg: RunConfig, out: str | None, world: int, device: str, info: dict | None,
            say) -> tuple[tuple, str]:
    """The worker's arguments (EvalJob, RunLayout) and the ranks' device type: every bad
    input refused here, before any process group; the planner's table (forward-only memory)
    said when it chose a degree."""
    job = plan_eval(cfg, out)
    run = resolve_eval(job.cfg, world, device, job.lengths, say=say)
    return (job, run), run.device


def _device(run) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if run.device == "cuda" \
        else torch.device("cpu")


def _worker(job, run) -> None:
    run_eval(job, run, dist.get_rank(), _device(run))


def evaluate(cfg: RunConfig, out: str | None = None) -> int:
    """Run ``usp-eval`` on ``cfg`` (``cfg.eval``); ``out``: the Hydra run directory, used
    when neither ``eval.out`` nor ``eval.run_dir`` is given. Returns the exit code."""
    return start(prepare(partial(_decide, cfg, out), cfg.trainer), _worker, cfg.trainer)
