"""The one home for private torch and flash-attn objects, each with the versions it was read from.

Adapters (``usp.kernels.aten``, ``usp.kernels.flash_attn``) get every private op from
here and know only how to call it, and ``usp.mesh`` reaches DeviceMesh and c10d internals
only through the functions at the end; on a torch or flash-attn upgrade, this file is
re-read against the new sources first.
"""

from __future__ import annotations

import inspect
import math
from typing import Callable, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

# torch 2.11-2.13 ``torch/utils/_python_dispatch.py`` (private): the base class of Python
# dispatch modes (``__torch_dispatch__(func, types, args, kwargs)``, entered with ``with``);
# ``tools.lab.memory.LiveTensorTracker`` subclasses it.
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: F401


class CudaSdpaOps(NamedTuple):
    """The four aten ops behind ``TorchKernel`` on CUDA (schemas as in torch 2.11-2.13).

    ``flash``/``flash_backward``: ``aten._scaled_dot_product_flash_attention[_backward]``,
    fp16/bf16, GQA native. ``efficient``/``efficient_backward``:
    ``aten._scaled_dot_product_efficient_attention[_backward]``, fp32 too, equal heads.
    A test seam: ``TorchKernel(cuda_ops=...)`` takes stand-ins with the same contract.
    """

    flash: Callable
    flash_backward: Callable
    efficient: Callable
    efficient_backward: Callable


def cuda_sdpa_ops() -> CudaSdpaOps:
    aten = torch.ops.aten
    return CudaSdpaOps(
        aten._scaled_dot_product_flash_attention,
        aten._scaled_dot_product_flash_attention_backward,
        aten._scaled_dot_product_efficient_attention,
        aten._scaled_dot_product_efficient_attention_backward,
    )


def cpu_flash_ops() -> tuple[Callable, Callable]:
    """``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward (torch >= 2.2):
    [B, H, S, d] in, (out, lse [B, H, S]) out, GQA native."""
    aten = torch.ops.aten
    return (aten._scaled_dot_product_flash_attention_for_cpu,
            aten._scaled_dot_product_flash_attention_for_cpu_backward)


def flash_rng_placeholders(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(philox_seed, philox_offset) exactly as the dense flash forward returns them without dropout.

    torch 2.11-2.13 (``flash_attn/flash_api.cpp`` ``mha_fwd``; ``_meta_registrations.py``):
    an uninitialised ``rng_state`` uint64 [2] and an ``_unused`` uint64 [] on the GPU, both
    only written when dropout_p > 0. ``mha_bwd`` reads ``philox_seed`` only when
    dropout_p > 0, so a backward of a no-dropout forward may be handed fresh ones: it sees
    the same dtypes and shapes and reads neither value.
    """
    return (torch.empty(2, dtype=torch.uint64, device=device),
            torch.empty((), dtype=torch.uint64, device=device))


def efficient_rng_placeholders() -> tuple[torch.Tensor, torch.Tensor]:
    """(philox_seed, philox_offset) as the efficient forward returns them without dropout.

    torch 2.11-2.13 ``_efficient_attention_forward``: ``empty({}, kLong)`` on the CPU outside
    CUDA-graph capture; ``_efficient_attention_backward`` reads them only when dropout_p > 0.
    """
    return torch.empty((), dtype=torch.int64), torch.empty((), dtype=torch.int64)


def efficient_lse_rows(seq_q: int) -> int:
    """Rows of the efficient forward's LSE for ``seq_q`` queries: padded to a multiple of 32.

    torch 2.11-2.13 CUDA ``_efficient_attention_forward`` allocates [B, H, ceil(S/32)*32]
    (``kAlignLSE``); its backward reads the LSE by pointer with only its batch and head
    strides, which ``check_supported`` wants divisible by 8 ("LSE is not correctly aligned").
    """
    return math.ceil(seq_q / 32) * 32


class FlashAttnOps(NamedTuple):
    """flash-attn's private ``_flash_attn_forward/_backward`` and their real parameter names."""

    forward: Callable
    backward: Callable
    forward_params: frozenset
    backward_params: frozenset


def op_params(fn: Callable) -> frozenset:
    """The parameter names ``fn`` accepts as keywords.

    flash-attn >= 2.7 wraps ``_flash_attn_forward/_backward`` in ``torch.library.custom_op``
    (torch >= 2.4): the ``CustomOpDef`` looks like ``(*args, **kwargs)`` to ``inspect``, so
    read the dispatcher schema it registered (the names of the wrapped function).
    """
    schema = getattr(getattr(fn, "_opoverload", None), "_schema", None)
    if schema is not None:
        return frozenset(a.name for a in schema.arguments)
    return frozenset(inspect.signature(fn).parameters)


def flash_attn_ops() -> FlashAttnOps:
    """Import flash-attn's private ops (read at tags v2.5.0-v2.8.3).

    2.5.x: ``window_size`` tuple, forward returns 8 values (lse at 5), backward returns
    (dq, dk, dv, softmax_d). 2.6.x: adds ``softcap`` after ``window_size``, same returns.
    2.7.0+: ``custom_op``s with ``window_size_left/right`` and ``softcap``; forward returns
    (out, softmax_lse, S_dmask, rng_state); backward writes dq/dk/dv in place and returns
    softmax_d. All versions write into the dq/dk/dv they are given.
    """
    try:
        from flash_attn import flash_attn_interface as fai
    except ImportError as e:  # pragma: no cover - depends on the machine
        raise ImportError(
            "kernel='flash_attn' needs the flash-attn package (CUDA only): "
            "pip install 'usp[gpu]', or use kernel='torch'"
        ) from e
    fwd, bwd = fai._flash_attn_forward, fai._flash_attn_backward
    return FlashAttnOps(fwd, bwd, op_params(fwd), op_params(bwd))


# ---- DeviceMesh and c10d internals (read in the torch 2.13.0 and 2.14.1 sources) ---------

def flatten_mesh(dm: DeviceMesh, name: str) -> DeviceMesh:
    """``dm`` (all its axes) as one 1-D DeviceMesh named ``name``, with one process group.

    ``DeviceMesh._flatten(name)``: private up to 2.14.1 at least; it creates the group once
    and keeps the flattened mesh in the root mesh's ``_flatten_mapping``, so a second call
    returns the same mesh. If it is renamed or made public, call that here; if it is gone,
    build the mesh from ``dist.new_group`` over the ranks of ``dm.mesh`` (every rank must
    create every group, in the same order) with ``DeviceMesh.from_group``.
    """
    return dm._flatten(name)


def release_device_mesh(dm: DeviceMesh | None) -> None:
    """Drop what a DeviceMesh holds, so that its process groups can be freed now.

    In 2.13.0 and 2.14.1 a mesh keeps its groups in ``_pg_registry``, and the root mesh keeps
    its flattened meshes in ``_flatten_mapping`` while each of them points back through
    ``_root_mesh`` (``_get_root_mesh()``): a reference cycle. ``_mesh_resources`` holds only
    the stack of ``with device_mesh:`` blocks, unused by usp. Missing attributes are skipped.
    When these names change, find where the new mesh stores its groups and flattened meshes
    and clear those; ``tests/e2e/test_clean_exit_scripts.py`` fails while any gloo worker thread of a
    closed mesh is still alive.
    """
    if dm is None:
        return
    for mesh in (dm, dm._get_root_mesh()):
        getattr(mesh, "_pg_registry", {}).clear()
        getattr(mesh, "_flatten_mapping", {}).clear()


def process_group_alive(pg: dist.ProcessGroup) -> bool:
    """Whether ``pg`` is still registered, i.e. not yet destroyed by
    ``dist.destroy_process_group`` (which refuses a group it does not know).

    ``dist.distributed_c10d._world.pg_map`` (2.13.0, 2.14.1): the registry of live groups.
    If it moves, ask the new registry here.
    """
    return pg in dist.distributed_c10d._world.pg_map
