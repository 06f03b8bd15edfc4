"""How a tensor reaches the wire, and what a failed or mismatched collective says.

Transport: gloo carries CPU tensors only. When a CUDA tensor meets a gloo group (several
processes sharing one GPU in a check), it travels through a CPU copy; CPU tensors and
NCCL are untouched (``stage_through_host``).
"""

from __future__ import annotations

import re
from contextlib import contextmanager

import torch
import torch.distributed as dist


def stage_through_host(device_type: str, backend: str) -> bool:
    """Whether a tensor on ``device_type`` must travel through a CPU copy on ``backend``.

    ``backend`` is ``dist.get_backend(group)``: one name ("gloo", "nccl") or a per-device
    list ("cpu:gloo,cuda:nccl"). True only for a non-CPU tensor whose device is served by
    gloo (or by nothing, when CPU's backend is gloo), which moves CPU memory only.
    """
    if device_type == "cpu":
        return False
    if ":" in backend:
        per_device = dict(part.split(":", 1) for part in backend.split(","))
        backend = per_device.get(device_type, per_device.get("cpu", ""))
    return backend == "gloo"


def on_wire(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """``x`` as ``group``'s backend can carry it: a CPU copy when it must be staged, else ``x``."""
    if stage_through_host(x.device.type, dist.get_backend(group)):
        return x.to("cpu", copy=True)
    return x


PEER_LOST = re.compile(r"timed out|connection (closed|reset|refused)|broken pipe", re.I)


def collective_error(err: BaseException, axis: str, ranks: list[int]) -> BaseException:
    """``err`` from a collective on ``axis`` over global ``ranks``, renamed when it means a
    peer never answered (gloo: "Timed out waiting 3000ms for recv operation to complete") or
    went away ("Connection closed by peer"); any other error is returned unchanged."""
    text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    if not isinstance(err, RuntimeError) or not PEER_LOST.search(text):
        return err
    if text.startswith("collective on "):  # already named by an inner naming_collectives
        return err
    ms = re.search(r"(\d+)\s*ms", text)
    waited = f" after {int(ms.group(1)) / 1000:g}s" if ms else ""
    what = "timed out" if "timed out" in text.lower() else "lost a peer"
    me = dist.get_rank() if dist.is_initialized() else "?"
    return RuntimeError(
        f"collective on {axis} ranks {ranks} {what}{waited} on rank {me}: a peer did not "
        f"answer (hung or dead; the launcher names the ranks still running); raise "
        f"trainer.timeout_s if that collective is legitimately slow [{text}]")


@contextmanager
def naming_collectives(axis: str, group: dist.ProcessGroup | None = None):
    """Run collectives on ``axis`` (``group``; None = the world) so that a timeout or a lost
    peer raises an error naming the axis and its global ranks (see ``collective_error``)."""
    try:
        yield
    except RuntimeError as e:
        ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
        named = collective_error(e, axis, ranks)
        if named is e:
            raise
        raise named from e


def check_agreement(what: str, value, group: dist.ProcessGroup | None = None) -> None:
    """Collective over ``group``: raise ``ValueError`` on every rank unless all pass the same
    ``value`` (any picklable, compared with ``==``), naming which ranks passed what.

    Different arguments per rank otherwise hang (mismatched groups) or silently compute
    something else (a different ``causal``); one small all-gather of objects catches it.
    """
    values = [None] * dist.get_world_size(group)
    dist.all_gather_object(values, value, group=group)
    if all(v == values[0] for v in values):
        return
    ranks = dist.get_process_group_ranks(group) if group is not None else range(len(values))
    by_value: dict[str, list[int]] = {}
    for r, v in zip(ranks, values):
        by_value.setdefault(repr(v), []).append(r)
    raise ValueError(f"ranks disagree on {what}: "
                     + "; ".join(f"ranks {rs}: {v}" for v, rs in by_value.items())
                     + "; every rank must pass the same arguments")
