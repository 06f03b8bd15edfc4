"""Per-layer activation arithmetic of the memory model (``usp.planner.memory``): what one
layer's attention call works with on a rank, beyond what it saves."""

from __future__ import annotations

from ..dims.heads import check_heads, head_split

FP32 = 4
KERNELS = ("torch", "flash_attn", "reference")


def attention_buffers(seq_len: int, ring: int, ulysses: int, hq: int, hkv: int, d: int,
                      dtype_bytes: int, kernel: str = "torch",
                      device: str = "cuda") -> tuple[float, float]:
    """(forward, backward) work bytes of one attention call for one sequence on the busiest
    ulysses rank, beyond the q, k, v, out, LSE it saves.

    Forward: the K/V block computed on and the one in flight (ring > 1); the fp32 output
    and LSE accumulators; one block's output with its fp32 copy and merge product (ring 1:
    the kernel output, its fp32 copy and the cast back); with ulysses, the caller's q, k, v
    in token layout. Backward: dout, fp32 dq, the own fp32 dK/dV, the kernel's grads for a
    block; ring > 1: the own, current and next K/V blocks and three fp32 dK/dV accumulators
    (being filled, sent, received). Kernel workspace: ``torch`` on CUDA in fp32 (the
    efficient kernel) expands K/V to the query heads (and dK/dV back); ``reference``
    holds fp32 [S, S] score matrices per head (3 forward, 5 backward); the CPU flash op and
    flash-attn work in tiles (not counted).
    """
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    a, r, u = dtype_bytes, ring, ulysses
    kv = check_heads(hq, hkv, u)
    h = max(head_split(hq, hkv, u).q_counts)
    S, T = seq_len / r, seq_len / (r * u)
    kv_block = 2 * S * kv * d * a  # one stacked K/V block [2, S, kv, d]
    low = FP32 if a < FP32 else 0  # an fp32 copy that is a new tensor only below fp32
    if r > 1:
        fwd = 2 * kv_block + S * h * (d + 1) * FP32 + S * h * d * (a + FP32 + low) + S * h * FP32
    else:
        fwd = S * h * d * (FP32 + (2 * a if low else 0)) + S * h * FP32
    if u > 1:
        fwd += T * (hq + 2 * hkv) * d * a
    grads = S * (h + 2 * kv) * d * a
    bwd = S * h * d * (a + FP32) + 2 * S * kv * d * FP32 + grads + kv_block
    if r > 1:
        bwd += 2 * kv_block + 3 * 2 * S * kv * d * FP32
    if kernel == "torch" and device == "cuda" and a == FP32 and kv < h:
        fwd += 2 * S * h * d * a
        bwd += 4 * S * h * d * a
    elif kernel == "reference":
        fwd += 3 * S * S * h * FP32
        bwd += 5 * S * S * h * FP32
    return fwd, bwd
