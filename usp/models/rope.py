"""Rotary position embedding: the rotation tables from global positions, and the rotation.

Positions are global token ids (from the layout), so every rank rotates its tokens alike
whatever share of the sequence it holds.
"""

from __future__ import annotations

import torch


def rope_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [*, n] long (global ids) -> (cos, sin), each [*, n, head_dim/2] fp32.

    Frequency i is ``theta ** (-2i / head_dim)``; the angle depends only on the position
    value, so any order or subset of positions gives the same rotation per token.
    """
    if head_dim % 2 != 0:
        raise ValueError(f"RoPE needs an even head_dim, got {head_dim}")
    inv_freq = theta ** (
        -torch.arange(0, head_dim, 2, dtype=torch.float64, device=positions.device) / head_dim
    )  # [hd/2]
    # fp64 outer product: exact angles even at positions in the millions
    angles = positions.to(torch.float64)[..., None] * inv_freq  # [*, n, hd/2]
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, n, H, hd] by (cos, sin) [n or B, n, hd/2] ("rotate half": i with i+hd/2)."""
    half = x.shape[-1] // 2
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]  # [B, n, H, hd/2] each
    c, s = cos.unsqueeze(-2), sin.unsqueeze(-2)  # [(B,) n, 1, hd/2]: broadcast over heads
    out = torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1)  # [B, n, H, hd]
    return out.to(x.dtype)
