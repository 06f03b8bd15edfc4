"""A launched run's rendezvous (torchrun / Slurm): the store its ranks meet in, the vote
they take on rank 0's decision before any process group, and joining the group."""

from __future__ import annotations

import pickle
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from .device import BACKENDS, cuda_index


class RendezvousError(RuntimeError):
    """This rank could not join its own job's group (port taken, another job's rendezvous).
    Unlike a refusal, it is this rank's own: the rank that raised it prints it."""


_IDENTITY_KEY = "usp/identity"


def _rendezvous_store(info: dict, timeout: timedelta) -> dist.Store:
    """The store this launch's ranks meet in: rank 0 serves it on ``master_port`` and
    publishes the launch's identity; every other rank checks it met its own launch. The
    group's keys live under that identity, so ranks of two launches never mix."""
    rank, host, port = info["rank"], info["master_addr"], info["master_port"]
    ident = info["identity"]
    fix = ("unset MASTER_PORT (usp then takes a port per job) or give each job its own"
           if info.get("port_source") == "MASTER_PORT" else "set MASTER_PORT to a free port")
    try:
        store = dist.TCPStore(host, port, info["world"], is_master=rank == 0, timeout=timeout,
                              wait_for_workers=False)
    except (RuntimeError, OSError) as e:
        if rank == 0 and ("EADDRINUSE" in str(e) or "already in use" in str(e).lower()):
            raise RendezvousError(
                f"rank 0 of {ident}: port {port} ({info.get('port_source')}) on {host} is "
                f"already taken, perhaps by another job on this node; {fix}") from None
        raise RendezvousError(f"rank {rank} of {ident}: no rendezvous at {host}:{port} "
                              f"({info.get('port_source')}) within {timeout}: {e}") from None
    if rank == 0:
        store.set(_IDENTITY_KEY, ident)
    else:
        met = store.get(_IDENTITY_KEY).decode()
        if met != ident:
            raise RendezvousError(
                f"rank {rank} of {ident} reached the rendezvous at {host}:{port} "
                f"({info.get('port_source')}), which belongs to {met}: two jobs on one port; "
                f"{fix}")
    return dist.PrefixStore(f"usp/{ident}/", store)


def rendezvous_store(info: dict, timeout_s: float = 600.0) -> dist.Store:
    """The store this launch's ranks meet in (``launcher_env``), before any process group.

    Under torchrun a client of the agent's store, one prefix per restart attempt; under
    Slurm a store of the job step's own, which refuses a rank of another job
    (``RendezvousError``); otherwise a store served by rank 0 on ``master_port``."""
    timeout = timedelta(seconds=timeout_s)
    if "store_prefix" in info:  # torchrun: a client of the agent's store, one prefix per attempt
        store = dist.TCPStore(info["master_addr"], info["master_port"], info["world"],
                              is_master=False, timeout=timeout)
        return dist.PrefixStore(info["store_prefix"], store)
    if "identity" in info:  # Slurm: a store of this job step's own, identity checked
        return _rendezvous_store(info, timeout)
    store = dist.TCPStore(info["master_addr"], info["master_port"], info["world"],
                          is_master=info["rank"] == 0, timeout=timeout, wait_for_workers=False)
    return dist.PrefixStore("usp/", store)


class SharedRefusal(ValueError):
    """A refusal every task of a launch raises alike, decided together before any process
    group (``decide_together``): rank 0 prints it once, the other tasks exit quietly."""


def _why(e: BaseException) -> str:
    """An exception as a refusal line: a ValueError/FileNotFoundError by its message, anything
    else with its type, so no message is ever empty."""
    text = str(e)
    if isinstance(e, (ValueError, FileNotFoundError)) and text:
        return text
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def start_together(store: dist.Store, info: dict, refusal: str | None,
                   timeout_s: float = 600.0) -> str | None:
    """Every task's verdict on its own checks, exchanged through ``store`` before any process
    group: None when all may start, else the one refusal every task raises: rank 0's when it
    refused, otherwise the first refusing rank's, named. So a task whose node lacks a file
    is heard, once. Rank 0, which serves the store under Slurm, stays until every task has
    read a refusal (at most ``timeout_s``), so none loses the store before it knows."""
    rank, world = info["rank"], info["world"]
    votes = dist.PrefixStore("start/", store)
    votes.set(f"rank{rank}", refusal or "")
    if rank == 0:
        keys = [f"rank{r}" for r in range(world)]
        votes.wait(keys, timedelta(seconds=timeout_s))
        said = [votes.get(k).decode() for k in keys]
        refused = [r for r, text in enumerate(said) if text]
        verdict = ""
        if refused and said[0]:
            verdict = said[0]
        elif refused:
            ranks = ", ".join(map(str, refused[:8])) + (", ..." if len(refused) > 8 else "")
            verdict = (f"rank {refused[0]} (of {len(refused)} refusing: {ranks}): "
                       f"{said[refused[0]]}")
        votes.set("verdict", verdict)
        deadline = time.monotonic() + timeout_s
        while verdict and votes.add("read", 0) < world - 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        return verdict or None
    verdict = votes.get("verdict").decode()
    votes.add("read", 1)
    return verdict or None


def decide_together(store: dist.Store, info: dict, decide, check, timeout_s: float = 600.0):
    """Before any process group: rank 0 runs ``decide()`` (the run's layout, say) and
    publishes its value in ``store``; every other task runs ``check(value)`` on its own
    config and machine; the verdicts meet (``start_together``). Returns the value on every
    task, or raises ``SharedRefusal`` on every task. Any exception in ``decide``/``check``
    is a refusal, so no task leaves the others waiting for its vote."""
    shared = dist.PrefixStore("decided/", store)
    value, refusal = None, None
    if info["rank"] == 0:
        try:
            value = decide()
        except Exception as e:
            refusal = _why(e)
        shared.set("value", pickle.dumps(value))
    else:
        value = pickle.loads(shared.get("value"))
        if value is not None:
            try:
                check(value)
            except Exception as e:
                refusal = _why(e)
    verdict = start_together(store, info, refusal, timeout_s)
    if verdict is not None:
        raise SharedRefusal(verdict)
    return value


def init_from_env(info: dict, device_type: str = "cpu", timeout_s: float = 600.0,
                  store: dist.Store | None = None) -> torch.device:
    """Join the process group described by ``launcher_env``; returns this rank's device.

    ``device_type``: "cpu" (gloo) or "cuda" (NCCL), the run's device as the launcher
    decided it (``choose_device``, carried in ``RunLayout.device``); on CUDA the rank drives
    GPU ``cuda_index(local_rank, visible GPUs)``. ``ValueError`` (e.g. cuda without a GPU)
    is raised before joining. ``timeout_s`` (``trainer.timeout_s``): collective timeout.
    The group meets in ``store`` (default: ``rendezvous_store(info)``).
    """
    if device_type not in BACKENDS:
        raise ValueError(f"device_type must be one of {', '.join(BACKENDS)}, got "
                         f"{device_type!r}; decide it with usp.launch.choose_device")
    index = None
    if device_type == "cuda":
        index = cuda_index(info["local_rank"], torch.cuda.device_count())
        torch.cuda.set_device(index)  # before NCCL binds a device
    if store is None:
        store = rendezvous_store(info, timeout_s)
    dist.init_process_group(BACKENDS[device_type], rank=info["rank"], world_size=info["world"],
                            timeout=timedelta(seconds=timeout_s), store=store)
    return torch.device(device_type, index)
