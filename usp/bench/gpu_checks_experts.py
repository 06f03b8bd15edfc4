"""The GPU check's experts section: expert parallelism's exchange on the device.

``check_experts``: four processes share ``device`` (gloo, as ``check_usp_attention``); each
holds its own tokens and, at expert degree 2 and 4, only its experts
(``usp.models.expert_parallel.ExpertGroup``: the row counts and the rows travel as device
tensors, the regrouping indices are built on the host and moved). Every rank's output and
input gradient, and every local expert's weight gradient, are compared with the same block
run in one process on all ranks' tokens: fp32 against fp64, within 2e-5 of the largest value;
bf16 against the one-process block in bf16 (the same routing: a token's router logits are
its own row's), within 2e-2 (outputs, input gradients) and 5e-2 (weight gradients, sums of
many bf16 products in another order)."""

from __future__ import annotations

import copy
import json
import os
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from .gpu_checks_attention import randn
from .gpu_sizes import Sizes

D, E, K, F, NPROCS = 64, 8, 2, 96, 4


def _run(block, x: torch.Tensor, cot: torch.Tensor):
    """(y, dx, {weight: grad}) of ``block`` on x [n, D] against cotangent ``cot``."""
    x = x.clone().requires_grad_(True)
    y, _ = block(x)
    (y.float() * cot.float()).sum().backward()
    return y.detach(), x.grad, {n: p.grad for n, p in block.experts.named_parameters()}


def _err(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest error over the largest value (fp64)."""
    return float((got.double() - want).abs().max() / want.abs().max().clamp(min=1e-30))


def _local(block, degree: int, index: int) -> None:
    """Keep only this rank's experts of ``block`` (plain tensors) and its ``ExpertGroup``."""
    from ..models.expert_parallel import ExpertGroup

    local = E // degree
    for name, p in list(block.experts.named_parameters(recurse=False)):
        part = p.detach()[index * local:(index + 1) * local].clone()
        setattr(block.experts, name, torch.nn.Parameter(part))
    block.ep = ExpertGroup(dist.group.WORLD if degree == NPROCS else _group(degree), degree,
                           index, E)


_GROUPS: dict = {}


def _group(degree: int):
    """This rank's group of ``degree`` consecutive ranks (every rank creates every group)."""
    if degree not in _GROUPS:
        for first in range(0, NPROCS, degree):
            g = dist.new_group(list(range(first, first + degree)))
            if first <= dist.get_rank() < first + degree:
                _GROUPS[degree] = g
    return _GROUPS[degree]


def _experts_worker(device_type: str, result_path: str) -> None:
    from ..models.moe import Qwen3MoeBlock

    rank = dist.get_rank()
    device = torch.device(device_type, 0 if device_type == "cuda" else None)
    gen = torch.Generator().manual_seed(4)
    xs, cots = (randn((NPROCS, 48, D), gen, device, torch.float64) for _ in range(2))
    torch.manual_seed(0)
    base = Qwen3MoeBlock(D, E, K, F, norm_topk_prob=True, init_std=0.1).to(device)
    ref = _run(copy.deepcopy(base).double(), xs.reshape(-1, D), cots.reshape(-1, D))
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        want = ref if dtype == torch.float32 else _run(
            copy.deepcopy(base).to(dtype), xs.reshape(-1, D).to(dtype), cots.reshape(-1, D))
        bound = (2e-5, 2e-5) if dtype == torch.float32 else (2e-2, 5e-2)
        for degree in (2, 4):
            block = copy.deepcopy(base).to(dtype)
            _local(block, degree, rank % degree)
            y, dx, grads = _run(block, xs[rank].to(dtype), cots[rank])
            n = xs.shape[1]
            errs = {"out": _err(y, want[0][rank * n:(rank + 1) * n].double()),
                    "dx": _err(dx, want[1][rank * n:(rank + 1) * n].double())}
            local = slice((rank % degree) * (E // degree), (rank % degree + 1) * (E // degree))
            errs["experts"] = 0.0
            for name, g in grads.items():  # each rank's experts in place, summed over ranks
                whole = torch.zeros(want[2][name].shape, dtype=torch.float32, device=device)
                whole[local] = g.float()
                dist.all_reduce(whole)
                errs["experts"] = max(errs["experts"], _err(whole, want[2][name].double()))
            ok = max(errs["out"], errs["dx"]) <= bound[0] and errs["experts"] <= bound[1]
            flag = torch.tensor([float(ok)], device=device)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
            rows.append(dict(degree=degree, dtype=str(dtype).split(".")[-1],
                             ok=bool(flag.item()), err={k: float(f"{v:.3g}") for k, v in
                                                        errs.items()}))
    if rank == 0:
        Path(result_path).write_text(json.dumps(rows))


def check_experts(device: torch.device, sizes: Sizes) -> list[dict]:
    """Expert parallelism's exchange on ``NPROCS`` processes sharing ``device`` (gloo)."""
    from ..launch import spawn_local

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "rows.json")
        spawn_local(_experts_worker, NPROCS, device.type, path,
                    threads=max(1, (os.cpu_count() or 1) // NPROCS))
        return json.loads(Path(path).read_text())
