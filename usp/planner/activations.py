"""Per-layer activation arithmetic of the memory model (``usp.planner.memory``): what one
layer saves on a rank, what its attention call, RoPE and norms work with beyond that, and
the moments of a layer's backward."""

from __future__ import annotations

from dataclasses import dataclass

from ..config import ModelConfig
from ..dims import work
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
    in token layout. Backward: dout, fp32 dq, the own fp32 dK/dV, the own K/V block, and one
    kernel call over a block (``usp.dims.work``: the call over the largest head group of
    any rank, and on ring 1 the fp32 dK/dV of a KV head split across calls); ring > 1: the
    current and next K/V blocks and three fp32 dK/dV accumulators (being filled, sent,
    received). Kernel workspace: on CUDA the flash kernels (``torch`` below fp32,
    ``flash_attn``) hold an fp32 dq accumulator, copies of the call's strided inputs and,
    with GQA, dK/dV expanded to the query heads (``work.call_bytes``); ``torch`` on CUDA in
    fp32 (the efficient kernel) expands K/V to the query heads (and dK/dV back);
    ``reference`` holds fp32 [S, S] score matrices per head (3 forward, 5 backward); the CPU
    flash op works in per-thread tiles (not counted).
    """
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    a, r, u = dtype_bytes, ring, ulysses
    kv = check_heads(hq, hkv, u)
    split = head_split(hq, hkv, u)  # each rank's own counts: its groups (the worst rank's)
    h = max(split.q_counts)
    S, T = seq_len / r, seq_len / (r * u)
    kv_block = 2 * S * kv * d * a  # one stacked K/V block [2, S, kv, d]
    low = FP32 if a < FP32 else 0  # an fp32 copy that is a new tensor only below fp32
    if r > 1:
        fwd = 2 * kv_block + S * h * (d + 1) * FP32 + S * h * d * (a + FP32 + low) + S * h * FP32
    else:
        fwd = S * h * d * (FP32 + (2 * a if low else 0)) + S * h * FP32
    if u > 1:
        fwd += T * (hq + 2 * hkv) * d * a
    flash = device == "cuda" and (kernel == "flash_attn" or kernel == "torch" and a < FP32)
    call = max(work.group_bytes(S, S, qc, kc, d, a, one_call=r == 1, workspace=flash)
               for qc, kc in set(zip(split.q_counts, split.kv_counts)))
    bwd = S * h * d * (a + FP32) + 2 * S * kv * d * FP32 + call + kv_block
    if r > 1:
        bwd += 2 * kv_block + 3 * 2 * S * kv * d * FP32
    if kernel == "torch" and device == "cuda" and a == FP32 and kv < h:
        fwd += 2 * S * h * d * a
        bwd += 4 * S * h * d * a
    elif kernel == "reference":
        fwd += 3 * S * S * h * FP32
        bwd += 5 * S * S * h * FP32
    return fwd, bwd


@dataclass(frozen=True)
class LayerBytes:
    """One layer's bytes on a rank for one sequence of ``T`` tokens on the rank (``S`` in its
    ring segment), as ``usp.models.decoder`` holds them. Each RMSNorm recomputes its fp32 work
    in backward (``RMSNorm.recompute``): autograd keeps its input (the tensor before it) and
    the next matmul its output, ``a D`` each."""

    inp: float  # a block's input [T, D]: what a checkpoint keeps
    attn: float  # the attention sub-layer's saved tensors (``layer_bytes``)
    norm: float  # a norm's input and output (the MLP norm's; the MLP's own: experts.mlp_memory)
    norm_work: float  # a norm's backward: its recomputed fp32 values and their gradients
    rope: float  # q, k, v in token layout and RoPE's fp32 work on the query heads
    grads: float  # backward's flowing gradients: the residual stream's and a branch's
    tables: float  # RoPE's cos and sin [T, d/2] fp32
    final_norm: float  # the final norm's input and output (the loss keeps the output)


def norm_work_bytes(model: ModelConfig, tokens: float) -> float:
    """The largest norm's backward work for ``tokens`` tokens a rank: six fp32 values an
    element of one of its tiles, a block norm's ``model.norm_tiles`` or more
    (``usp.dims.work.norm_tiles``; ``usp.models.decoder.RMSNorm``), and with ``qk_norm``
    the q norm's over the ``Hq d`` elements of a token. A transformers model's norms
    (``model.hf``) are its own: whole."""
    widths = [(model.dim, model.norm_tiles)]
    if model.qk_norm:
        widths.append((model.n_heads * model.head_dim, 1))
    if model.hf is not None:
        return work.NORM_WORK * max(w for w, _ in widths) * tokens
    return max(work.NORM_WORK * w * tokens / work.norm_tiles(t, tokens, w) for w, t in widths)


def layer_bytes(model: ModelConfig, tokens: float, segment: float, h: int, kv: int,
                dtype_bytes: int) -> LayerBytes:
    """``LayerBytes`` of ``model``'s layer for ``tokens`` = L/P tokens on the rank, ``segment``
    = L/r, ``h``/``kv`` the query/KV heads of the busiest ulysses rank.

    Attention saves its norm's input and output (``2 a D``), the q/k norms' inputs with
    ``qk_norm`` (``a (Hq + Hkv) d``), the o-projection's input (``a Hq d``), and per segment
    token the ring's q, k, v, out in head layout (``a``) and LSE (fp32). RoPE saves only its
    tables; its work (forward, and again in backward) is three fp32 copies of the query
    heads beside q, k, v (measured: 12 bytes per element). A norm's backward holds six fp32
    values per channel (measured: 24 bytes) of one of its ``norm_tiles`` sequence tiles
    (``norm_work_bytes``), beside its input."""
    m, a, T, S = model, dtype_bytes, tokens, segment
    D, d, hq, hkv = m.dim, m.head_dim, m.n_heads, m.n_kv_heads
    qk = a * (hq + hkv) * d * T if m.qk_norm else 0.0
    attn = (2 * a * D * T + qk + a * hq * d * T
            + S * (2 * h * d * a + 2 * kv * d * a + h * FP32))
    return LayerBytes(inp=a * D * T, attn=attn, norm=2 * a * D * T,
                      norm_work=norm_work_bytes(m, T),
                      rope=a * (hq + 2 * hkv) * d * T + 3 * FP32 * hq * d * T,
                      grads=2 * a * D * T, tables=FP32 * d * T, final_norm=2 * a * D * T)


def backward_moments(lb: LayerBytes, held: float, res: list[float], mlps: list[tuple],
                     checkpointed: list[bool], part: str, batch: int,
                     attention_work: float) -> dict[str, float]:
    """Each layer's backward moments (bytes), from the MLP's to its attention norm's: ``held``
    is what every layer's backward holds (state, every layer's resident ``res``, RoPE tables,
    offloaded inputs on the device), less the layer's own ``res[i]`` and plus what the layer
    holds then. ``mlps``: ``experts.mlp_memory`` per layer; ``attention_work``: the attention
    call's backward buffers (``attention_buffers``), per sequence."""
    B, out = batch, {}
    for i, (_, _, mlp_work) in enumerate(mlps):
        base = held - res[i] + B * lb.grads
        ck = checkpointed[i]
        # the attention's saved tensors, or only its input when its recompute is still ahead
        attn_now = lb.inp if ck and part == "attention" else lb.attn
        mlp_saved = lb.norm + mlps[i][0]
        out[f"backward of layer {i}'s MLP"] = base + B * (attn_now + mlp_saved + mlp_work)
        out[f"backward of layer {i}'s MLP norm"] = base + B * (
            attn_now + lb.inp + lb.norm_work)
        out[f"backward of layer {i}'s attention"] = base + B * (lb.attn + attention_work)
        out[f"backward of layer {i}'s RoPE"] = base + B * (lb.norm + lb.rope)
        out[f"backward of layer {i}'s attention norm"] = base + B * (lb.inp + lb.norm_work)
    return out
