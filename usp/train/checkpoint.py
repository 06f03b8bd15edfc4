"""Checkpoint and resume with torch.distributed.checkpoint (DCP).

Layout: ``run_dir/checkpoints/step_000120/`` holds the DCP shards of the model and optimizer
(layout-independent: a checkpoint written under (ulysses, ring) = (2, 2) loads under (4, 1)),
``extra.pt`` (scheduler, step, data position) and ``rng_rank{r}.pt`` per rank.

Crash safety: a checkpoint is written into ``step_K.tmp`` and renamed to ``step_K`` by rank 0
only after every rank has finished writing; a crash mid-save leaves a ``.tmp`` directory that
is ignored (and removed by the next save), never a damaged ``step_K``.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

_STEP_DIR = re.compile(r"^step_(\d{6,})$")


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint under ``run_dir/checkpoints``, or None."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return None
    done = [p for p in root.iterdir() if _STEP_DIR.match(p.name) and (p / "extra.pt").exists()]
    return max(done, key=lambda p: int(_STEP_DIR.match(p.name).group(1)), default=None)


def save_checkpoint(run_dir: str | Path, step: int, model, optimizer, scheduler,
                    extra: dict | None = None, keep: int = 2) -> Path:
    """Collective: every rank writes its shards; returns the final directory."""
    root = Path(run_dir) / "checkpoints"
    final = root / f"step_{step:06d}"
    tmp = root / f"step_{step:06d}.tmp"
    rank = dist.get_rank()
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob("*.tmp"):  # left by an earlier crash mid-save
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir()
    dist.barrier()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp))
    save_rng(tmp / f"rng_rank{rank}.pt")
    dist.barrier()
    if rank == 0:
        # extra.pt is written last: its presence marks the checkpoint complete
        torch.save({"step": step, "scheduler": scheduler.state_dict(), **(extra or {})},
                   tmp / "extra.pt")
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        _prune(root, keep)
    dist.barrier()
    return final


def load_checkpoint(path: str | Path, model, optimizer, scheduler) -> dict:
    """Collective: restore model, optimizer, scheduler and this rank's RNG; returns extra."""
    path = Path(path)
    if not (path / "extra.pt").exists():
        raise ValueError(f"{path} is not a complete checkpoint (no extra.pt)")
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
    extra = torch.load(path / "extra.pt", weights_only=False)
    scheduler.load_state_dict(extra["scheduler"])
    rng = path / f"rng_rank{dist.get_rank()}.pt"
    extra["rng_restored"] = rng.exists()
    if rng.exists():  # absent when the world size changed: the caller reseeds
        load_rng(rng)
    return extra


def save_rng(path: str | Path) -> None:
    """Write this process's CPU RNG state, and the current CUDA device's when there is one."""
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    torch.save(state, path)


def load_rng(path: str | Path) -> None:
    """Restore what ``save_rng`` wrote: the CPU state, and the CUDA state on the current
    device when the file has one and CUDA is available (a GPU run resumed on CPU keeps
    only the CPU state)."""
    state = torch.load(path, weights_only=False)
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _prune(root: Path, keep: int) -> None:
    done = sorted((p for p in root.iterdir() if _STEP_DIR.match(p.name)), key=lambda p: p.name)
    for old in done[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
