"""Checkpoint and resume with torch.distributed.checkpoint (DCP), with files that can be trusted.

Layout: ``run_dir/checkpoints/step_000120/`` holds the DCP shards of the model and optimizer
(layout-independent: a checkpoint written under (ulysses, ring) = (2, 2) loads under (4, 1)),
``extra.pt`` (scheduler, step, data position), ``rng_rank{r}.pt`` per rank and ``manifest.json``.

Crash safety: a checkpoint is written into ``step_K.tmp`` and renamed to ``step_K`` by rank 0
only after every rank has finished writing; a crash mid-save leaves a ``.tmp`` directory that
is ignored (and removed by the next save), never a renamed ``step_K``.

Trust: ``manifest.json`` is written last (by rank 0, after every rank's files exist) and lists
every file's relative path, size and sha256, the step and the run fingerprint. Each rank
hashes the files it wrote (its own DCP shards and RNG state) and rank 0 gathers the digests,
so no rank reads all shards. sha256 rather than crc32: hardware-accelerated in hashlib (so
not much slower on large shards, which are streamed in 8 MiB chunks), no practical chance of
a damaged file keeping its digest, and checkable by hand with ``sha256sum``.
On resume, ``choose_checkpoint`` (collective; every rank verifies a share of the files) takes
the newest checkpoint that verifies; a damaged newer one is named in one line and skipped.

Checkpoints written before manifests (``extra.pt`` without a ``format`` key, no
``manifest.json``) are accepted with a one-line warning: they load unverified and without
the resume-config check. A checkpoint whose ``extra.pt`` says it had a manifest but has none
is incomplete and skipped.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

_STEP_DIR = re.compile(r"^step_(\d{6,})$")
_RANK_FILE = re.compile(r"^(?:__(\d+)_\d+\.distcp|rng_rank(\d+)\.pt)$")  # written by that rank
MANIFEST = "manifest.json"
FORMAT = 2  # extra.pt["format"]: 2 = the checkpoint has a manifest; absent = written before
_CHUNK = 8 << 20


# ---- the resume check: the fingerprint (usp.train.fingerprint) must not change -----------

def check_resume(saved: dict, current: dict, where: str | Path = "the checkpoint") -> None:
    """Refuse to resume when the run settings changed: ValueError naming every key that differs
    as ``key: saved -> now``. Keys only one side knows (a newer or older usp) are not compared."""
    diff = [f"{k}: {saved[k]!r} -> {current[k]!r}" for k in sorted(saved.keys() & current.keys())
            if saved[k] != current[k]]
    if diff:
        raise ValueError(f"cannot resume from {where}: the run settings changed ({'; '.join(diff)}); "
                         f"restore them, use a new trainer.run_dir, or set trainer.resume=false")


# ---- verification ---------------------------------------------------------------------------

def read_manifest(path: str | Path) -> dict | None:
    """``path/manifest.json`` as a dict, or None when the file does not exist."""
    f = Path(path) / MANIFEST
    return json.loads(f.read_text()) if f.exists() else None


def verify_checkpoint(path: str | Path, part: int = 0, parts: int = 1,
                      checksum: bool = True) -> str | None:
    """Why checkpoint ``path`` cannot be trusted (one phrase), or None when it can.

    Checks the share ``files[part::parts]`` of its manifest (sorted by name): the file exists,
    has the recorded size and, with ``checksum``, the recorded sha256. A checkpoint from before
    manifests is trusted when its ``extra.pt`` loads (see the module docstring)."""
    path = Path(path)
    try:
        manifest = read_manifest(path)
    except (OSError, ValueError) as e:
        return f"{MANIFEST} unreadable ({e})"
    if manifest is None:
        return None if _is_legacy(path) else f"no {MANIFEST} (the save did not finish)"
    if not isinstance(manifest.get("files"), dict):
        return f"{MANIFEST} has no file list"
    for name, rec in sorted(manifest["files"].items())[part::parts]:
        f = path / name
        if not f.is_file():
            return f"missing file {name}"
        size = f.stat().st_size
        if size != rec["size"]:
            return f"{name} is {size} bytes, the manifest says {rec['size']}"
        if checksum and _sha256(f) != rec["sha256"]:
            return f"{name} fails its sha256 (same size, different bytes)"
    return None


def step_dirs(run_dir: str | Path) -> list[Path]:
    """Every ``step_K`` directory under ``run_dir/checkpoints``, newest (largest K) first,
    whether it verifies or not."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if _STEP_DIR.match(p.name) and p.is_dir()),
                  key=step_of, reverse=True)


def latest_checkpoint(run_dir: str | Path, verify: bool = True,
                      log: Callable[[str], None] = print) -> Path | None:
    """The newest checkpoint under ``run_dir/checkpoints`` that verifies, or None. Each newer
    one that does not is named in one ``log`` line and skipped. ``verify=False``: sizes only,
    no checksums. Reads every file: one process; on a process group use ``choose_checkpoint``."""
    for path in step_dirs(run_dir):
        why = verify_checkpoint(path, checksum=verify)
        if why is None:
            _warn_legacy(path, log)
            return path
        log(_skip_line(path, why))
    return None


def choose_checkpoint(run_dir: str | Path, log: Callable[[str], None] = print) -> Path | None:
    """Collective: ``latest_checkpoint`` on a process group, the same answer on every rank.

    Rank 0 lists the candidates; every rank checks its share of each one's files (newest
    first) and the checkpoint is taken only when no rank found a problem. Rank 0 logs one
    line per skipped checkpoint. None when there is no checkpoint; ValueError when there are
    some and none verifies (resuming from scratch would silently lose the run)."""
    if not (dist.is_available() and dist.is_initialized()):
        found = list(step_dirs(run_dir))
        best = latest_checkpoint(run_dir, log=log)
        if found and best is None:
            raise ValueError(_none_verifies(run_dir, len(found)))
        return best
    rank, world = dist.get_rank(), dist.get_world_size()
    box = [list(map(str, step_dirs(run_dir))) if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)  # the same candidate list on every rank
    for path in map(Path, box[0]):
        whys = [None] * world
        dist.all_gather_object(whys, verify_checkpoint(path, rank, world))
        why = next((w for w in whys if w is not None), None)
        if why is None:
            if rank == 0:
                _warn_legacy(path, log)
            return path
        if rank == 0:
            log(_skip_line(path, why))
    if box[0]:
        raise ValueError(_none_verifies(run_dir, len(box[0])))
    return None


# ---- save and load --------------------------------------------------------------------------

def save_checkpoint(run_dir: str | Path, step: int, model, optimizer, scheduler,
                    extra: dict | None = None, keep: int = 2,
                    fingerprint: dict | None = None, records: dict | None = None) -> Path:
    """Collective: every rank writes and hashes its shards, rank 0 writes ``extra.pt`` and
    the manifest last, renames ``step_K.tmp`` to ``step_K`` and keeps the ``keep`` newest
    complete checkpoints (always this one). ``fingerprint``: the run's
    (``usp.train.fingerprint.run_fingerprint(cfg)``), checked by ``load_checkpoint``.
    ``records``: {file name: text} rank 0 writes beside ``extra.pt`` (hashed like the rest;
    ``usp.models.run_records``'s model config and data record). Returns the final directory."""
    root = Path(run_dir) / "checkpoints"
    final = root / f"step_{step:06d}"
    tmp = root / f"step_{step:06d}.tmp"
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob("*.tmp"):  # left by an earlier crash mid-save
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir()
    dist.barrier()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp))
    save_rng(tmp / f"rng_rank{rank}.pt")
    dist.barrier()  # every rank's shards exist
    if rank == 0:
        torch.save({"step": step, "format": FORMAT, "scheduler": scheduler.state_dict(),
                    **(extra or {})}, tmp / "extra.pt")
        for name, text in (records or {}).items():
            (tmp / name).write_text(text)
    # each rank hashes the files it wrote (rank 0 also .metadata, extra.pt and any other)
    mine = {name: {"size": (tmp / name).stat().st_size, "sha256": _sha256(tmp / name)}
            for name in _files(tmp) if _owner(name, world) == rank}
    shares = [None] * world if rank == 0 else None
    dist.gather_object(mine, shares, dst=0)
    if rank == 0:
        files = {k: v for share in shares for k, v in share.items()}
        manifest = {"step": step, "hash": "sha256", "fingerprint": fingerprint or {},
                    "files": dict(sorted(files.items()))}
        # written last: its presence marks the checkpoint complete
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        _prune(root, keep, final)
    dist.barrier()
    return final


def load_checkpoint(path: str | Path, model, optimizer, scheduler,
                    fingerprint: dict | None = None) -> dict:
    """Collective: restore model, optimizer, scheduler and this rank's RNG; returns extra.

    ``fingerprint`` (``usp.train.fingerprint.run_fingerprint(cfg)``): checked against the
    manifest's with ``check_resume`` before anything is loaded (ValueError on every rank
    alike)."""
    path = Path(path)
    if not (path / "extra.pt").exists():
        raise ValueError(f"{path} is not a complete checkpoint (no extra.pt); resume from "
                         f"choose_checkpoint(run_dir) or set trainer.resume=false")
    manifest = read_manifest(path)
    if fingerprint is not None and manifest is not None:
        check_resume(manifest.get("fingerprint", {}), fingerprint, path)
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


# ---- helpers --------------------------------------------------------------------------------

def step_of(p: Path) -> int | None:
    """The optimizer step of checkpoint directory ``p`` (``step_000700``: 700), None for a
    directory named otherwise (a copy of a checkpoint)."""
    found = _STEP_DIR.match(Path(p).name)
    return None if found is None else int(found.group(1))


def _files(d: Path) -> list[str]:
    return sorted(str(f.relative_to(d)) for f in d.rglob("*") if f.is_file())


def _owner(name: str, world: int) -> int:
    """The rank that wrote ``name`` (DCP's ``__{rank}_{n}.distcp``, ``rng_rank{rank}.pt``); 0
    for everything else, so every file is hashed by exactly one rank."""
    m = _RANK_FILE.match(name)
    r = int(m.group(1) or m.group(2)) if m else 0
    return r if r < world else 0


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_CHUNK):  # streamed: shards can be many GB
            h.update(block)
    return h.hexdigest()


def _is_legacy(path: Path) -> bool:
    """Written before manifests: ``extra.pt`` loads and has no ``format`` key."""
    try:
        extra = torch.load(path / "extra.pt", weights_only=False)
    except Exception:  # missing or damaged: not a usable checkpoint of any age
        return False
    return isinstance(extra, dict) and "format" not in extra


def _warn_legacy(path: Path, log: Callable[[str], None]) -> None:
    if not (path / MANIFEST).exists():
        log(f"checkpoint {path} predates manifests (no {MANIFEST}): loading it unverified and "
            f"without the resume-config check")


def _skip_line(path: Path, why: str) -> str:
    return f"checkpoint {path} is damaged: {why}; skipping it for the previous one"


def _none_verifies(run_dir, n: int) -> str:
    return (f"none of the {n} checkpoints under {Path(run_dir) / 'checkpoints'} verifies (each "
            f"named above); restore one, use a new trainer.run_dir, or set trainer.resume=false")


def _complete(p: Path) -> bool:
    """Cheap completeness (no checksums): every manifest file present with its size."""
    return verify_checkpoint(p, checksum=False) is None


def _prune(root: Path, keep: int, newest: Path) -> None:
    """Keep ``newest`` (just written and hashed) and the ``keep - 1`` next newest complete
    checkpoints; delete every other ``step_K`` (older ones and damaged ones). A damaged
    checkpoint never takes the place of an intact one."""
    others = [p for p in step_dirs(root.parent) if p != newest]
    kept = {newest, *[p for p in others if _complete(p)][:max(keep - 1, 0)]}
    for old in others:
        if old not in kept:
            shutil.rmtree(old, ignore_errors=True)
