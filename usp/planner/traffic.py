"""Bytes one ``usp_attention`` call sends per rank: the one comm-volume formula.

The planner's cost model prices these bytes, and ``tests/test_comm_volume.py`` checks the
``CommStats`` that real calls record against them, so the planner is tied to real traffic.

Ulysses (per rank, to its u-1 peers): the fused q/k/v all-to-all carries Hq/u query heads
and ``kv = max(Hkv/u, 1)`` KV heads (x2 for K and V) per destination; the output all-to-all
carries Hq/u heads back. Backward mirrors both. Ring: r-1 hops of a K+V block [B, L/r, kv,
d] forward; backward the same K/V hops plus r-1 hops of the fp32 dK+dV accumulator (each
block's accumulator starts at the rank after its owner and ends at the owner).
"""

from __future__ import annotations

from ..validate import check_heads

FP32 = 4


def attention_bytes(batch: int, seq_len: int, hq: int, hkv: int, head_dim: int, ulysses: int,
                    ring: int, elem_bytes: int) -> tuple[dict, dict]:
    """({"ulysses": bytes, "ring": bytes} forward, the same backward) sent by one rank."""
    u, r = ulysses, ring
    kv = check_heads(hq, hkv, u)
    n, s = seq_len // (u * r), seq_len // r  # tokens per rank, per ring segment
    a2a_in = (u - 1) * batch * n * (hq // u + 2 * kv) * head_dim * elem_bytes
    a2a_out = (u - 1) * batch * n * (hq // u) * head_dim * elem_bytes
    kv_block = 2 * batch * s * kv * head_dim * elem_bytes
    acc_block = 2 * batch * s * kv * head_dim * FP32
    fwd = {"ulysses": a2a_in + a2a_out, "ring": (r - 1) * kv_block}
    bwd = {"ulysses": a2a_out + a2a_in, "ring": (r - 1) * (kv_block + acc_block)}
    return fwd, bwd
