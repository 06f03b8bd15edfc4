"""How ``usp-eval`` starts its ranks, as ``usp-train`` does (``usp.launch.job``):
``trainer.nprocs`` local ranks, or the tasks torchrun/Slurm started, which meet in the
rendezvous store before any process group so that a refusal is said once. What the ranks
run is decided by the resolver (``usp.run.eval_args``)."""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist

from ..config import RunConfig
from ..launch.job import prepare, start
from ..run import eval_args
from .runner import run_eval


def _device(run) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if run.device == "cuda" \
        else torch.device("cpu")


def _worker(job, run) -> None:
    run_eval(job, run, dist.get_rank(), _device(run))


def evaluate(cfg: RunConfig, out: str | None = None) -> int:
    """Run ``usp-eval`` on ``cfg`` (``cfg.eval``); ``out``: the Hydra run directory, used
    when neither ``eval.out`` nor ``eval.run_dir`` is given. Returns the exit code."""
    return start(prepare(partial(eval_args, cfg, out), cfg.trainer), _worker, cfg.trainer)
