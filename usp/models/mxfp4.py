"""MXFP4 expert weights (released gpt-oss checkpoints, ``quantization_config.quant_method:
mxfp4``), dequantized at load into the built-in model's fused [E, ...] layout.

A fused expert weight ``W`` [E, C, R] (the built-in layout, ``x @ W[e]``: gate_up_proj
[E, D, 2F], down_proj [E, F, D]) is stored as two tensors beside its name:

    W_blocks  [E, R, C/32, 16] uint8   two FP4 (e2m1) codes a byte: the low nibble is the even
                                       element of its pair, the high one the odd
    W_scales  [E, R, C/32]     uint8   one power of two per block of 32: 2 ** (scale - 127)

that is, stored transposed ([E, R, C], a row per output), each row in blocks of 32 values
sharing an exponent (transformers' ``integrations.mxfp4.convert_moe_packed_tensors``, which
this follows). A code is sign (bit 3) and one of 0, 0.5, 1, 1.5, 2, 3, 4, 6. Dequantized in
fp32 every value is exact (a code times a power of two), and stays exact in bf16.
"""

from __future__ import annotations

import torch

# the 16 e2m1 codes, by their 4-bit value
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
              -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCK = 32  # values sharing one scale
SUFFIXES = ("_blocks", "_scales")


def packed_names(name: str) -> tuple[str, str]:
    """The checkpoint tensors (blocks, scales) that hold the fused expert weight ``name``."""
    return name + SUFFIXES[0], name + SUFFIXES[1]


def is_packed(name: str, stored) -> bool:
    """The checkpoint holding the tensors ``stored`` has ``name`` in MXFP4, not as itself."""
    return name not in stored and all(p in stored for p in packed_names(name))


def packed_shapes(shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The (blocks, scales) shapes of a fused weight of ``shape`` [E, C, R]."""
    e, c, r = shape
    return (e, r, c // BLOCK, BLOCK // 2), (e, r, c // BLOCK)


def dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """blocks [E, R, G, 16] uint8, scales [E, R, G] uint8 -> the weight [E, G*32, R] fp32
    (the fused layout: transposed back)."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != BLOCK // 2:
        raise ValueError(f"MXFP4 blocks {list(blocks.shape)} and scales {list(scales.shape)} "
                         f"do not pair: blocks are [..., G, {BLOCK // 2}] for scales [..., G]")
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    codes = blocks.to(torch.int32)  # indices into lut (int32: half int64's bytes)
    out = torch.stack((lut[codes & 0x0F], lut[codes >> 4]), dim=-1)  # [E, R, G, 16, 2]
    out = out.flatten(-2)  # [E, R, G, 32]: low nibble even, high nibble odd
    out = torch.ldexp(out, scales.to(torch.int32)[..., None] - 127)  # x 2 ** (scale - 127)
    return out.flatten(-2).transpose(-1, -2)  # [E, R, G*32] -> [E, C, R]


def read_experts(files, name: str, start: int, n: int) -> torch.Tensor:
    """Experts [start, start + n) of the fused weight ``name`` stored in MXFP4, dequantized:
    [n, C, R] fp32. ``files(tensor_name)`` gives the open safetensors file holding a tensor;
    only those experts' blocks and scales are read."""
    blocks, scales = (files(p).get_slice(p)[start:start + n] for p in packed_names(name))
    return dequantize(blocks, scales)
