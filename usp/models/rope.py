"""Rotary position embedding: the rotation tables from global positions, and the rotation.

Positions are global token ids (from the layout), so every rank rotates its tokens alike
whatever share of the sequence it holds.
"""

from __future__ import annotations

import math

import torch


def _mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature for a length factor (1 when nothing is extended)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _llama3(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    """Llama 3.1: long wavelengths (beyond the original context / low_freq_factor) slowed by
    ``factor``, short ones (below context / high_freq_factor) kept, a linear blend between."""
    old = s["original_max_position_embeddings"]
    low, high, factor = s["low_freq_factor"], s["high_freq_factor"], s["factor"]
    wavelen = 2 * math.pi / inv_freq  # [hd/2]
    blend = ((old / wavelen - low) / (high - low)).clamp(0, 1)  # 0: slowed, 1: kept
    out = (1 - blend) * inv_freq / factor + blend * inv_freq
    out = torch.where(wavelen > old / low, inv_freq / factor, out)
    return torch.where(wavelen < old / high, inv_freq, out)


def _yarn(inv_freq: torch.Tensor, head_dim: int, theta: float, s: dict) -> torch.Tensor:
    """YaRN (Peng et al. 2023): frequencies that turn fewer than ``beta_slow`` times over the
    original context are interpolated (divided by ``factor``), those that turn more than
    ``beta_fast`` times are kept, with a linear ramp over the dimensions between."""
    old, factor = s["original_max_position_embeddings"], s["factor"]

    def dim_of(turns: float) -> float:  # the dimension whose frequency turns `turns` times
        return head_dim * math.log(old / (turns * 2 * math.pi)) / (2 * math.log(theta))

    lo, hi = dim_of(s.get("beta_fast", 32.0)), dim_of(s.get("beta_slow", 1.0))
    if s.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, head_dim - 1)
    if lo == hi:
        hi += 0.001  # a step, not a division by zero
    i = torch.arange(head_dim // 2, dtype=torch.float64, device=inv_freq.device)
    interpolated = ((i - lo) / (hi - lo)).clamp(0, 1)  # 0: kept, 1: divided by factor
    return inv_freq / factor * interpolated + inv_freq * (1 - interpolated)


def inverse_frequencies(head_dim: int, theta: float, scaling: dict | None = None,
                        device: torch.device | str | None = None) -> tuple[torch.Tensor, float]:
    """The RoPE frequencies [head_dim/2] fp64 and the attention factor (which scales cos and
    sin, so the attention logits by its square) for base ``theta`` and ``scaling`` (a dict
    checked by ``usp.config.rope.check_rope_scaling``; None: plain RoPE,
    ``theta ** (-2i / head_dim)``). The same formulas as transformers' ``rope_parameters``
    of each ``rope_type``."""
    if head_dim % 2 != 0:
        raise ValueError(f"RoPE needs an even head_dim, got {head_dim}")
    inv_freq = theta ** (
        -torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim
    )  # [hd/2]
    kind = (scaling or {}).get("rope_type", "default")
    if kind == "default":
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / scaling["factor"], 1.0
    if kind == "llama3":
        return _llama3(inv_freq, scaling), 1.0
    if kind == "yarn":
        factor = scaling["factor"]
        attention = scaling.get("attention_factor")
        if attention is None:
            ms, ms_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
            attention = (_mscale(factor, ms) / _mscale(factor, ms_all) if ms and ms_all
                         else _mscale(factor))
        return _yarn(inv_freq, head_dim, theta, scaling), float(attention)
    raise ValueError(f"unknown rope_type {kind!r}; see usp.config.rope.ROPE_TYPES")


def rope_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float, scaling: dict | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [*, n] long (global ids) -> (cos, sin), each [*, n, head_dim/2] fp32.

    The frequencies are ``inverse_frequencies(head_dim, theta, scaling)``; both tables carry
    its attention factor. The angle depends only on the position value, so any order or
    subset of positions gives the same rotation per token.
    """
    inv_freq, attention = inverse_frequencies(head_dim, theta, scaling, positions.device)
    # fp64 outer product: exact angles even at positions in the millions
    angles = positions.to(torch.float64)[..., None] * inv_freq  # [*, n, hd/2]
    return (angles.cos() * attention).float(), (angles.sin() * attention).float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, n, H, hd] by (cos, sin) [n or B, n, hd/2] ("rotate half": i with i+hd/2)."""
    half = x.shape[-1] // 2
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]  # [B, n, H, hd/2] each
    c, s = cos.unsqueeze(-2), sin.unsqueeze(-2)  # [(B,) n, 1, hd/2]: broadcast over heads
    out = torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1)  # [B, n, H, hd]
    return out.to(x.dtype)
