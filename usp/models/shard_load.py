"""Each rank reads only its shard of a ``model.pretrained`` checkpoint.

The built-in model is built on the meta device (no weights allocated), sharded by FSDP2
(every parameter a ``DTensor`` over the dp x sp ranks, split along dim 0), given empty local
storage (``to_empty``), and each rank copies in, from the safetensors files, only the rows
its shard holds (``safe_open(...).get_slice(name)[start:stop]``: the file is memory-mapped
and only those rows are read). A rank so adds its shard (``size / P``) and one tensor's
rows at a time, not the whole checkpoint. Usage, on every rank::

    with torch.device("meta"):
        model = Transformer(mc, attn_fn)
    shard_model(model, mesh, dtype)            # usp.train.trainer.shard_model (FSDP2)
    load_shards(model, mc, device)

A mixture of experts' fused [E, ...] weights, sharded along the expert dim, are filled expert
by expert from the checkpoint's per-expert tensors (``usp.models.pretrained.stacked``), or
from its MXFP4 blocks and scales (gpt-oss's, ``usp.models.mxfp4``), dequantized, each rank
reading its own experts' rows.
``tools/bench_load.py`` measures the memory it takes.
"""

from __future__ import annotations

from contextlib import ExitStack

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from ..config import ModelConfig
from . import mxfp4
from .pretrained import expected_tensors, packed, stacked, tensor_index


def _rows(param) -> tuple[torch.Tensor, int, int]:
    """(this rank's local tensor, first row, row count) of a parameter sharded on dim 0
    (a plain tensor: all of it)."""
    if not isinstance(param, DTensor):
        return param.data, 0, param.shape[0]
    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh,
                                                          param.placements)
    if any(o != 0 for o in offset[1:]) or tuple(shape[1:]) != tuple(param.shape[1:]):
        raise ValueError(f"a parameter sharded as {param.placements}: usp reads dim-0 "
                         "shards (FSDP) only")
    return param.to_local(), offset[0], shape[0]


@torch.no_grad()
def load_shards(model, mc: ModelConfig, device: torch.device | str) -> None:
    """Give the meta-device, FSDP-sharded built-in ``model`` storage on ``device`` and fill
    each parameter's local rows from ``mc.pretrained`` (collective-free: every rank reads
    its own rows). ValueError when a checkpoint tensor is missing or of another shape."""
    from safetensors import safe_open

    model.to_empty(device=device)
    where = tensor_index(mc.pretrained)  # name -> (file, shape), headers only
    wanted = expected_tensors(mc, where)  # checkpoint name -> (parameter, shape)
    params = dict(model.named_parameters())
    by_file: dict = {}
    for hf, (usp, shape) in wanted.items():
        if hf not in where or where[hf][1] != shape:
            raise ValueError(f"model.pretrained={mc.pretrained}: {hf} is "
                             f"{'missing' if hf not in where else list(where[hf][1])}, "
                             f"the model's {usp} is {list(shape)}")
        by_file.setdefault(where[hf][0], []).append((hf, usp))
    apart = stacked(mc, where)  # expert weights stored per expert: read by expert
    quantized = packed(mc, where)  # ... in MXFP4: dequantized, this rank's experts
    for path, names in by_file.items():
        with safe_open(str(path), framework="pt") as st:
            for hf, usp in names:
                local, start, n = _rows(params[usp])
                if n and usp not in apart and usp not in quantized:
                    rows = st.get_slice(hf)[start:start + n]  # only these rows are read
                    local.copy_(rows.to(device=local.device, dtype=local.dtype))
    for usp, experts in apart.items():
        _load_experts(params[usp], experts, where)
    for usp, name in quantized.items():
        _load_packed(params[usp], name, where)


def _load_experts(param, experts: list[tuple[str, ...]], where: dict) -> None:
    """Fill the local experts [start, start + n) of a fused [E, ...] ``param`` from their
    per-expert tensors (``experts[j]``: concatenated along dim 0), one expert at a time;
    each file they sit in is opened once."""
    from safetensors import safe_open

    local, start, n = _rows(param)
    with ExitStack() as stack:
        files: dict = {}

        def tensor(name: str) -> torch.Tensor:
            path = where[name][0]
            if path not in files:
                files[path] = stack.enter_context(safe_open(str(path), framework="pt"))
            return files[path].get_tensor(name)

        for j in range(n):  # the sharded dim is the expert dim: whole experts, this rank's
            rows = torch.cat([tensor(name) for name in experts[start + j]])
            local[j].copy_(rows.to(device=local.device, dtype=local.dtype))


def _load_packed(param, name: str, where: dict) -> None:
    """Fill the local experts [start, start + n) of a fused [E, C, R] ``param`` from its MXFP4
    blocks and scales (``name``: the weight's name in the checkpoint), one expert at a time:
    only those experts' bytes are read, and one expert's fp32 weight is made at a time."""
    from safetensors import safe_open

    local, start, n = _rows(param)
    with ExitStack() as stack:
        files: dict = {}

        def opened(tensor: str):
            path = where[tensor][0]
            if path not in files:
                files[path] = stack.enter_context(safe_open(str(path), framework="pt"))
            return files[path]

        for j in range(n):
            w = mxfp4.read_experts(opened, name, start + j, 1)[0]  # [C, R] fp32
            local[j].copy_(w.to(device=local.device, dtype=local.dtype))
