"""Optional adapter: the ring-flash-attn package as the ring engine (CUDA only).

ring-flash-attn 0.1.8 imports flash_attn and transformers at import time (and breaks with
transformers 5.x), so it is imported only when ``ring_impl="ring_flash_attn"`` is asked
for. Its zigzag layout (ring rank i holds chunks i and 2r-1-i) is the same as ours.
"""

from __future__ import annotations


def _import():
    try:
        import ring_flash_attn as rfa
    except ImportError as e:  # pragma: no cover - depends on the machine
        raise ImportError(
            "ring_impl='ring_flash_attn' needs the ring-flash-attn package with flash-attn "
            "and transformers<5 (CUDA only): pip install 'usp[gpu]' 'transformers<5'; "
            "or use ring_impl='usp'"
        ) from e
    return rfa


def ring_flash_attn(q, k, v, mesh, balance: str, causal: bool, scale: float):
    """q [B, L/r, Hq/u, d], k/v [B, L/r, Hkv', d] on this ring rank -> out, same layout as q."""
    if mesh.to_group_rank("ring") is not None:
        raise ValueError(
            "ring-flash-attn orders its ring by process-group rank, but this mesh's ring "
            f"coordinates follow the host layout ({mesh.axis_ranks('ring')}); use ring_impl='usp'"
        )
    rfa = _import()
    fn = rfa.zigzag_ring_flash_attn_func if balance == "zigzag" else rfa.ring_flash_attn_func
    return fn(q, k, v, dropout_p=0.0, softmax_scale=scale, causal=causal, group=mesh.group("ring"))
