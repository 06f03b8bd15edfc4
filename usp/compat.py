"""The one home for private torch and flash-attn objects, each with the versions it was read from.

Adapters (``usp.kernels.aten``, ``usp.kernels.flash_attn``) get every private op from
here and know only how to call it; on a torch or flash-attn upgrade, this file is re-read
against the new sources first.
"""

from __future__ import annotations

import inspect
import math
from typing import Callable, NamedTuple

import torch


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
