"""Calibrate the planner's cost model against this machine and against published figures.

One run does three things:

1. **Micro-measures this machine** on N local gloo processes (all at once, as in training):
   a small and a large ``all_to_all_single`` (latency and bytes/s per rank), a small and a
   large ``batch_isend_irecv`` ring step, the LSE merge (``usp.ring.merge``) as a
   bandwidth, how much of a ring transfer hides behind a kernel call, and the attention
   kernel's achieved FLOP/s (aten CPU flash, ``usp.kernels.local_attention``, forward and
   forward+backward). It prints the values and the YAML lines for
   ``configs/cluster/cpu_local.yaml``.
2. **Times usp attention** forward+backward for several (ulysses, ring) and sequence
   lengths, the way ``tools/bench_attention.py`` does: every timed call sits between
   barriers, its time is the slowest rank's, and all entries (every layout at every
   length, plus the kernel probe) run round-robin in the same processes, so load from
   other processes lands on all of them alike. Each layout is also run *compute-only*: the
   same ring code with a loopback in place of the P2P ring and no all-to-all, so the
   measured time splits into kernel+merge work and the rest (communication, copies, waits).
3. **Predicts the same calls** with the cost model (``usp.planner.cost.estimate``) on the
   calibrated spec and prints measured vs predicted, their ratio, and whether the model
   orders the layouts as measured.

The attention-only part of ``estimate`` is read from its ``StepCost`` fields: with
``act_checkpoint=False``, forward+backward attention = ``attn_s + merge_s + a2a_s +
ring_exposed_s`` (the rest of the step is matmuls, the LM head and gradients). The model
has no forward-only entry point; because its only use of ``act_checkpoint`` is to run each
forward term once more, forward-only = (the same sum with ``act_checkpoint=True``) minus
(the sum without). These baseline predictions use no formula of their own.

``proposed_attention`` is a prototype of two changes to the model's attention part, with
both parameters measured here rather than fitted to the attention times: ``overlap``, the
share of a ring transfer that really hides behind the block computed meanwhile (the model
assumes all of it), and ``causal_tile``, the extra work a causal block does on its
diagonal (tiles cut by the mask are computed whole: a causal n x n block costs
n^2/2 (1 + tile/n) instead of n^2/2, at the kernel's non-causal rate). With
``overlap=1, causal_tile=0`` it reproduces ``estimate`` (tested).

Repeated times are summarized by their minimum (``--stat``; load from other processes only
adds time), and the summary lines are printed for the median as well.

Then it sets the model beside benchmark figures published by ring-flash-attn and USP
(yunchang): the numbers and their sources are in ``RFA`` and ``USP_*``, the hardware specs
in ``published_specs()``.

    python tools/calibrate_planner.py                  # 80-110 s on this 2-core box
    python tools/calibrate_planner.py --quick          # smoke test, about 20 s
    python tools/calibrate_planner.py --published-only # the published comparison, no processes
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from usp import SPMesh, SequenceLayout, usp_attention  # noqa: E402
from usp.config import ModelConfig  # noqa: E402
from usp.kernels import get_kernel, local_attention  # noqa: E402
from usp.launch import spawn_local  # noqa: E402
from usp.planner import ClusterSpec, estimate, group_span, load_cluster  # noqa: E402
from usp.planner.cost import FLASH_BWD, FP32, ring_pass, ring_step_link  # noqa: E402
from usp.ring import RingAttention, merge  # noqa: E402
from usp.validate import check_heads, seq_multiple  # noqa: E402

FULL = dict(seq_lens=(2048, 4096, 8192), warmup=1, iters=4)
QUICK = dict(seq_lens=(1024, 2048), warmup=1, iters=2)
PROBE = (4096, 2)  # kernel probe [1, L, H, 64] causal: the (u=4, r=1, L=4096) per-rank work
PROBE_NC = (2048, 2)  # the same kernel without the mask: its rate is the one without diagonal waste


@dataclass(frozen=True)
class Shape:
    """One attention call: global [B, L, H, d] query, [B, L, Hkv, d] keys/values."""

    batch: int
    seq_len: int
    heads: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int = 4
    causal: bool = True


# ---- the model side (pure) ------------------------------------------------------------------


def _attention_terms(spec: ClusterSpec, shape: Shape, ulysses: int, ring: int, balance: str,
                     act_checkpoint: bool) -> dict:
    model = ModelConfig(vocab_size=1, dim=shape.heads * shape.head_dim, n_layers=1,
                        n_heads=shape.heads, n_kv_heads=shape.kv_heads, ffn_dim=1)
    c = estimate(model, spec, shape.seq_len, 1, ring, ulysses, global_batch=shape.batch,
                 dtype_bytes=shape.dtype_bytes, causal=shape.causal, fsdp=False,
                 balance=balance, act_checkpoint=act_checkpoint)
    return dict(compute=c.attn_s, merge=c.merge_s, a2a=c.a2a_s, ring_exposed=c.ring_exposed_s)


def predict_attention(spec: ClusterSpec, shape: Shape, ulysses: int, ring: int,
                      balance: str = "zigzag") -> dict:
    """The cost model's time (s) for one attention call on one rank: ``fwd_bwd`` and ``fwd``,
    with the forward+backward split into ``compute`` (kernel FLOPs), ``merge``, ``a2a`` and
    ``ring_exposed``."""
    once = _attention_terms(spec, shape, ulysses, ring, balance, act_checkpoint=False)
    twice = _attention_terms(spec, shape, ulysses, ring, balance, act_checkpoint=True)
    fwd_bwd = sum(once.values())
    return dict(once, fwd_bwd=fwd_bwd, fwd=sum(twice.values()) - fwd_bwd)


def proposed_attention(spec: ClusterSpec, shape: Shape, ulysses: int, ring: int,
                       balance: str = "zigzag", overlap: float | None = None,
                       causal_tile: float = 0.0) -> float:
    """PROTOTYPE of a revised attention model, forward+backward seconds per rank.

    Same terms as ``usp.planner.cost.estimate`` (act_checkpoint off, dp 1) except:
    a ring transfer hides only ``overlap`` of the compute it runs beside
    (exposed = send - overlap * min(send, compute); default: the spec's own ``overlap``,
    which the model uses too), and the
    diagonal (causal) block costs ``1 + causal_tile / block`` times its half-square FLOPs."""
    overlap = spec.overlap if overlap is None else overlap
    L, u, r, B = shape.seq_len, ulysses, ring, shape.batch
    hq, hd, eb = shape.heads, shape.head_dim, shape.dtype_bytes
    kv = check_heads(hq, shape.kv_heads, u)
    T, rate = L / (u * r), spec.peak_flops * spec.mfu
    a2a = 0.0
    if u > 1:
        us = group_span(1, r, u, spec.ranks_per_node, "ulysses", "ulysses_inner")
        lat = spec.inter_latency_s if us.remote_peers else spec.intra_latency_s
        intra_bw = spec.link_bw(False, us.intra_senders)
        inter_bw = spec.link_bw(True, us.inter_senders)

        def a2a_time(heads):
            chunk = T * heads * hd * eb
            return lat + max(us.local_peers * chunk / intra_bw,
                             us.remote_peers * chunk / inter_bw)

        a2a = 2 * (a2a_time(hq / u + 2 * kv) + a2a_time(hq / u))  # forward + backward mirrors
    blk = L / r
    full = 4 * blk * blk * (hq / u) * hd / rate
    diag = full / 2 * (1 + causal_tile / blk) if shape.causal else full
    later = full / 2 if shape.causal and balance == "zigzag" else full
    compute = (1 + FLASH_BWD) * (diag + (r - 1) * later)
    ring_t = 0.0
    if r > 1:
        rs = group_span(1, r, u, spec.ranks_per_node, "ring", "ulysses_inner")
        bw, lat = ring_step_link(spec, rs)
        kv_bytes = 2 * blk * kv * hd * eb
        q_el, kv_el = blk * (hq / u) * hd, blk * kv * hd
        merge_f = 3 * FP32 * q_el / spec.hbm_bw
        merge_b = 3 * FP32 * (q_el + 2 * kv_el) / spec.hbm_bw
        send_kv = lat + kv_bytes / bw
        send_acc = lat + kv_bytes * FP32 / eb / bw
        _, exposed, _ = ring_pass(r, 1, send_kv, send_acc, diag, later, merge_f, merge_b,
                                  overlap)
        ring_t = exposed + (r - 1) * (merge_f + merge_b)
    return B * (compute + a2a + ring_t)


def causal_tile_from_rates(n: int, causal_rate: float, full_rate: float) -> float:
    """Diagonal waste (tokens) that makes an n x n causal block run at ``causal_rate`` when
    unmasked blocks run at ``full_rate``: causal_rate = full_rate * n / (n + tile)."""
    return max(0.0, n * (full_rate / causal_rate - 1))


def fit_link(small_bytes: float, small_s: float, large_bytes: float, large_s: float):
    """(bytes/s, latency s) of ``t = latency + bytes / bw`` through two measured points.

    ``bytes`` is what one rank sends to others. If the large message was not slower (noise),
    the bandwidth is the large message's plain rate and the latency the small one's time."""
    if large_s <= small_s or large_bytes <= small_bytes:
        return large_bytes / large_s, small_s
    bw = (large_bytes - small_bytes) / (large_s - small_s)
    return bw, max(small_s - small_bytes / bw, 1e-9)


def calibrated_spec(base: ClusterSpec, micro: dict) -> ClusterSpec:
    """``base`` with this machine's measured links, kernel rate and merge bandwidth.

    all-to-all -> intra_*, P2P ring step -> inter_* (the CPU recipes simulate nodes whose
    ring crosses them); ``mfu`` = achieved attention FLOP/s per rank / ``peak_flops``."""
    return base.replace(
        intra_bw=micro["a2a_bw"], intra_latency_s=micro["a2a_lat_s"],
        inter_bw=micro["p2p_bw"], inter_latency_s=micro["p2p_lat_s"],
        mfu=min(1.0, micro["kernel_flops"] / base.peak_flops), hbm_bw=micro["merge_bw"],
    )


def yaml_lines(spec: ClusterSpec) -> str:
    """The ClusterSpec as ``configs/cluster/*.yaml`` lines (field order of the dataclass)."""
    out = []
    for key, val in asdict(spec).items():
        if key == "mem_bytes" or not isinstance(val, float):
            val = int(val) if key == "mem_bytes" else val
        elif key == "mfu":
            val = f"{val:.4f}"
        else:
            mant, exp = f"{val:.3e}".split("e")
            val = f"{mant}e{int(exp):+d}"
        out.append(f"{key}: {val}")
    return "\n".join(out)


def ranking(times: dict) -> list:
    """Keys ordered fastest first."""
    return sorted(times, key=times.get)


def pairwise_agreement(rounds: dict, predicted: dict) -> tuple[int, int, int]:
    """(agree, resolved, pairs) over all pairs of configs.

    ``rounds``: config -> per-round measured times (same rounds for all); a pair is
    *resolved* when one config was faster in every round; ``agree`` counts resolved pairs
    whose faster config the model also predicts faster."""
    names = list(rounds)
    agree = resolved = pairs = 0
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            pairs += 1
            wins = [x < y for x, y in zip(rounds[a], rounds[b])]
            if all(wins) or not any(wins):
                resolved += 1
                agree += (predicted[a] < predicted[b]) == wins[0]
    return agree, resolved, pairs


# ---- published figures ----------------------------------------------------------------------

RFA_SOURCE = ("https://github.com/zhuzilin/ring-flash-attention README.md, 'The current "
              "performance' table, batch api (commit 01c8baf); shapes from "
              "benchmark/benchmark_kvpacked_func.py")
# iter/s, B=1, 8192 tokens per GPU (65536 over 8 GPUs), 32 query / 8 KV heads, d=128, bf16,
# causal. "flash" is flash_attn_kvpacked_func on 8192 tokens, one GPU: the README's
# "theoretic" ring rate is flash / 8 (a ring rank does 8x that work).
RFA = {
    ("H800", "fwd"): dict(flash=591.5, ring_attn=38.5, zigzag_ring=63.0),
    ("H800", "fwd+bwd"): dict(flash=154.7, ring_attn=10.4, zigzag_ring=17.4),
    ("A100", "fwd"): dict(flash=373.4, ring_attn=24.0, zigzag_ring=38.2),
    ("A100", "fwd+bwd"): dict(flash=94.7, ring_attn=6.2, zigzag_ring=10.6),
}
USP_ISSUE40 = ("https://github.com/feifeibear/long-context-attention/issues/40 (maintainer, "
               "2024-04-15): fwd only, BS=2, NHEADS=8, HEAD_SIZE=128, GROUP_NUM=1, 8 GPUs "
               "on one NVLink node; 'in four iterations ring-attn elapse is over 100ms, while "
               "Ulysses is about 60ms'")
USP_README = ("https://github.com/feifeibear/long-context-attention README.md, '6. Benchmark' "
              "(commit fd66c2f); figures are images, only the text conclusions are quoted")
USP_ISSUE73 = ("https://github.com/feifeibear/long-context-attention/issues/73 (maintainer, "
               "2024-09-03): on 8xL20 'ulysses=4, ring=2' performs best, the topology being "
               "a 2x4 grid (PCIe switch + QPI)")


def published_specs() -> dict:
    """Cluster specs for the published hardware (our YAMLs where they fit).

    H800 = H100 SXM compute with NVLink cut to 400 GB/s bidirectional (200 per direction);
    A100 = ``a100_ib``. L20: 119.5 TFLOP/s dense bf16, 864 GB/s GDDR6, PCIe Gen4 (25 GB/s
    assumed, as ``l40s_roce``); the 2x4 variant treats each PCIe switch as a 'node' with an
    assumed 10 GB/s cross-socket path."""
    h100, a100, l40s = (load_cluster(n) for n in ("h100_ib", "a100_ib", "l40s_roce"))
    l20 = l40s.replace(name="l20_pcie", nodes=1, peak_flops=119.5e12, hbm_bw=0.864e12)
    return {
        "H800": h100.replace(name="h800_nvlink", nodes=1, intra_bw=200e9),
        "A100": a100.replace(name="a100_nvlink", nodes=1),
        "L20": l20,
        "L20 2x4": l20.replace(name="l20_2x4", ranks_per_node=4, nodes=2, inter_bw=10e9,
                               inter_latency_s=20e-6),
    }


def published_rows() -> list[dict]:
    """Published figure vs the model's figure for the same setup, one dict per row."""
    specs, rows = published_specs(), []
    one = Shape(batch=1, seq_len=8192, heads=32, kv_heads=8, head_dim=128, dtype_bytes=2)
    ring8 = Shape(batch=1, seq_len=8 * 8192, heads=32, kv_heads=8, head_dim=128, dtype_bytes=2)
    for (gpu, mode), fig in RFA.items():
        spec = specs[gpu]
        solo = predict_attention(spec.replace(ranks_per_node=1), one, 1, 1)[mode.replace("+", "_")]
        for impl, bal in (("zigzag_ring", "zigzag"), ("ring_attn", "contiguous")):
            t = predict_attention(spec, ring8, 1, 8, bal)[mode.replace("+", "_")]
            rows.append(dict(source="ring-flash-attn", hw=f"8x{gpu}",
                             what=f"{impl} {mode}: rate / (flash_attn rate / 8)",
                             published=fig[impl] / (fig["flash"] / 8), model=8 * solo / t))
        rows.append(dict(source="ring-flash-attn", hw=f"1x{gpu}", what=f"flash_attn {mode} iter/s "
                         "(absolute, 8192 tok)", published=fig["flash"], model=1 / solo))
    for gpu in ("H800", "A100"):
        f, fb = RFA[(gpu, "fwd")]["flash"], RFA[(gpu, "fwd+bwd")]["flash"]
        rows.append(dict(source="ring-flash-attn", hw=f"1x{gpu}", what="flash_attn bwd time / "
                         "fwd time", published=f / fb - 1, model=2.5))
    a100 = specs["A100"]
    for local in (16384, 8192):  # the issue profiles both lengths; it does not say which is timed
        sh = Shape(batch=2, seq_len=8 * local, heads=8, kv_heads=8, head_dim=128, dtype_bytes=2)
        uly = predict_attention(a100, sh, 8, 1)["fwd"]
        for impl, bal in (("basic", "contiguous"), ("zigzag", "zigzag")):
            ring = predict_attention(a100, sh, 1, 8, bal)["fwd"]
            rows.append(dict(source="USP issue 40", hw="8xA100? NVLink", what=f"fwd ring({impl}) / "
                             f"ulysses, 8 ranks, {local} tok/rank", published=100 / 60,
                             model=ring / uly,
                             note="published is a lower bound (> 100 ms / ~60 ms)"))
    for name in ("L20", "L20 2x4"):
        spec = specs[name]
        for local in (4096, 32768):
            sh = Shape(batch=1, seq_len=8 * local, heads=32, kv_heads=8, head_dim=128,
                       dtype_bytes=2)
            t = {u: predict_attention(spec, sh, u, 8 // u)["fwd"] for u in (8, 4, 2, 1)}
            best = min(t, key=t.get)
            rows.append(dict(source="USP README/issue 73", hw=f"8xL20 ({spec.name})",
                             what=f"best (ulysses, ring), fwd, {local} tok/rank, 32/8 heads",
                             published="(2,4) README; (4,2) issue 73",
                             model=f"({best},{8 // best}); " + ", ".join(
                                 f"u{u} {t[u] / t[best]:.3f}" for u in t)))
    return rows


def format_published(rows: list[dict]) -> str:
    out = [f"{'source':<20} {'hardware':<20} {'figure':<58} {'published':>10} {'model':>10} "
           f"{'model/pub':>9}"]
    for r in rows:
        p, m = r["published"], r["model"]
        if isinstance(p, str) or isinstance(m, str):
            out.append(f"{r['source']:<20} {r['hw']:<20} {r['what']:<58}\n{'':>22}published "
                       f"{p}\n{'':>22}model     {m}")
            continue
        out.append(f"{r['source']:<20} {r['hw']:<20} {r['what']:<58} {p:>10.3f} {m:>10.3f} "
                   f"{m / p:>9.3f}" + (f"  ({r['note']})" if r.get("note") else ""))
    return "\n".join(out)


# ---- measurement (every rank) -----------------------------------------------------------------


class LoopbackComm:
    """Stands in for ``usp.comm.RingComm``: every block 'arrives' as the one sent, so the
    ring runs all its kernel calls and merges with no transfer (blocks have the same
    shapes, so the work is the same)."""

    def start(self, send: torch.Tensor, tag: int = 0):
        return _Arrived(send)


class _Arrived:
    def __init__(self, t):
        self.recv = t

    def wait(self):
        return self.recv


def _timed(fn, reps: int) -> list[float]:
    """The slowest rank's seconds for each of ``reps`` calls of ``fn()`` (all ranks call it)."""
    ts = torch.zeros(reps, dtype=torch.float64)
    for i in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        ts[i] = time.perf_counter() - t0
    dist.all_reduce(ts, op=dist.ReduceOp.MAX)
    return ts.tolist()


def micro(args) -> dict:
    n, rank = dist.get_world_size(), dist.get_rank()
    out = {}
    # all-to-all: chunk bytes to each of n-1 peers; t = lat + (n-1) chunk / bw (the model's form)
    for tag, chunk, reps in (("small", 1024, 30), ("large", args.a2a_kib * 1024, 8)):
        x = torch.randn(n * chunk // 4)
        y = torch.empty_like(x)
        out[f"a2a_{tag}_s"] = _timed(lambda: dist.all_to_all_single(y, x), reps)
        out[f"a2a_{tag}_bytes"] = (n - 1) * chunk
    # ring step: send to next, receive from previous, as usp.comm.RingComm does
    nxt, prv = (rank + 1) % n, (rank - 1) % n

    def p2p(s, r):
        for q in dist.batch_isend_irecv([dist.P2POp(dist.isend, s, nxt),
                                         dist.P2POp(dist.irecv, r, prv)]):
            q.wait()

    for tag, nbytes, reps in (("small", 1024, 30), ("large", args.p2p_kib * 1024, 8)):
        s = torch.randn(nbytes // 4)
        r = torch.empty_like(s)
        out[f"p2p_{tag}_s"] = _timed(lambda: p2p(s, r), reps)
        out[f"p2p_{tag}_bytes"] = nbytes
    # merge of one block into the fp32 accumulator: [1, S, H, d], the model counts 3 fp32 passes
    S, H, d = 2048, 8, 64
    acc, lse = torch.randn(1, S, H, d), torch.randn(1, H, S)
    blk, blk_lse = torch.randn(1, S, H, d), torch.randn(1, H, S)
    out["merge_s"] = _timed(lambda: merge(acc, lse, blk, blk_lse), 10)
    out["merge_bytes"] = 3 * 4 * S * H * d
    # overlap: a ring transfer posted, a kernel call, then the wait (what each ring step does)
    q, k, v = (torch.randn(1, 2048, 2, 64) for _ in range(3))
    s = torch.randn(args.p2p_kib * 1024 // 4)
    r = torch.empty_like(s)

    def kernel():
        with torch.no_grad():
            local_attention(q, k, v, causal=True)

    def post():
        return dist.batch_isend_irecv([dist.P2POp(dist.isend, s, nxt),
                                       dist.P2POp(dist.irecv, r, prv)])

    out["ovl_kernel_s"], out["ovl_comm_s"], out["ovl_both_s"] = overlap_times(
        kernel, post, args.overlap_reps)
    return out


def overlap_times(kernel, post, reps: int, warmup: int = 0) -> tuple[list, list, list]:
    """Slowest rank's seconds of ``kernel()`` alone, of a transfer alone (``post()`` returns
    its requests, which are then waited on) and of both (post, kernel, wait: what each
    ring step does), the three timed back to back ``reps`` times. For ``overlap_share``."""

    def transfer(beside=None):
        reqs = post()
        if beside is not None:
            beside()
        for x in reqs:
            x.wait()

    fns = (kernel, transfer, lambda: transfer(beside=kernel))
    for _ in range(warmup):
        for fn in fns:
            fn()
    ovl = torch.zeros(reps, 3, dtype=torch.float64)  # interleaved, like the rounds
    for i in range(reps):
        for j, fn in enumerate(fns):
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            ovl[i, j] = time.perf_counter() - t0
    dist.all_reduce(ovl, op=dist.ReduceOp.MAX)
    kernel_s, comm_s, both_s = ovl.T.tolist()
    return kernel_s, comm_s, both_s


def _prepare(args):
    """Timed entries: (name, fn) for the kernel probe and, per length and layout, the full
    usp call and its compute-only replay."""
    B, H, Hkv, d, kernel = args.batch, args.heads, args.kv_heads, args.head_dim, get_kernel("torch")
    entries = []
    pq, pk, pv, pdo = (torch.randn(1, PROBE[0], PROBE[1], d, requires_grad=i < 3) for i in range(4))

    def probe_fwd():
        with torch.no_grad():
            local_attention(pq, pk, pv, causal=True)

    def probe_fb():
        for t in (pq, pk, pv):
            t.grad = None
        local_attention(pq, pk, pv, causal=True).backward(pdo)

    nq, nk, nv, ndo = (torch.randn(1, PROBE_NC[0], PROBE_NC[1], d, requires_grad=i < 3)
                       for i in range(4))

    def probe_nc():
        for t in (nq, nk, nv):
            t.grad = None
        local_attention(nq, nk, nv, causal=False).backward(ndo)

    entries += [("kernel fwd", probe_fwd), ("kernel fwd+bwd", probe_fb),
                ("kernel fwd+bwd non-causal", probe_nc)]
    meshes = {(u, r): SPMesh.build(ulysses=u, ring=r) for u, r in args.layouts}
    g = torch.Generator().manual_seed(0)
    for L in args.seq_lens:
        q, dout = (torch.randn(B, L, H, d, generator=g) for _ in range(2))
        k, v = (torch.randn(B, L, Hkv, d, generator=g) for _ in range(2))
        for (u, r), mesh in meshes.items():
            layout = SequenceLayout(mesh, seq_len=L, balance=args.balance)
            ins = [layout.shard(t, dim=1).detach().clone().requires_grad_(True) for t in (q, k, v)]
            dl = layout.shard(dout, dim=1).detach().clone()

            def full(ins=ins, dl=dl, mesh=mesh, layout=layout):
                for t in ins:
                    t.grad = None
                usp_attention(*ins, mesh=mesh, layout=layout, causal=True,
                              kernel="torch").backward(dl)

            kv = check_heads(H, Hkv, u)  # [B, L/r, H/u | kv, d]: what the ring sees after the a2a
            loc = [torch.randn(B, L // r, h, d).requires_grad_(True) for h in (H // u, kv, kv)]
            ldo = torch.randn(B, L // r, H // u, d)

            def local(loc=loc, ldo=ldo, mesh=mesh, r=r):
                for t in loc:
                    t.grad = None
                RingAttention.apply(*loc, LoopbackComm(), mesh.ring_rank, r, True, args.balance,
                                    kernel, d ** -0.5).backward(ldo)

            entries += [(f"usp L={L} u={u} r={r}", full), (f"local L={L} u={u} r={r}", local)]
    return entries


def run_rank(args, raw_path: str) -> None:
    rank = dist.get_rank()
    say = print if rank == 0 else (lambda *a, **k: None)
    say(f"micro-measurements on {dist.get_world_size()} processes x "
        f"{torch.get_num_threads()} threads ...", flush=True)
    res = dict(micro=micro(args))
    entries = _prepare(args)
    say(f"{len(entries)} timed entries x (warmup {args.warmup} + {args.iters} rounds), "
        "round-robin ...", flush=True)
    times = torch.zeros(args.iters, len(entries), dtype=torch.float64)
    for it in range(-args.warmup, args.iters):
        start = it % len(entries)
        for j in list(range(start, len(entries))) + list(range(start)):
            dist.barrier()
            t0 = time.perf_counter()
            entries[j][1]()
            t1 = time.perf_counter()
            if it >= 0:
                times[it, j] = t1 - t0
        say(f"  round {it + 1}/{args.iters}" if it >= 0 else "  warmup", flush=True)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)  # per round: the slowest rank
    res["rounds"] = {name: times[:, j].tolist() for j, (name, _) in enumerate(entries)}
    if rank == 0:
        Path(raw_path).write_text(json.dumps(res))
    dist.barrier()


# ---- analysis and report (parent process) ----------------------------------------------------


def _median(xs):
    return float(torch.tensor(xs, dtype=torch.float64).median())


# External load only ever adds time, so the fastest of the interleaved rounds is the best
# estimate of the undisturbed machine; the median is reported beside it.
STATS = {"min": min, "median": _median}


def summarize_micro(m: dict, n: int, threads: int) -> dict:
    """Link fits, merge bandwidth, kernel rates and overlap from the micro numbers (one
    statistic per measurement already taken)."""
    a2a_bw, a2a_lat = fit_link(m["a2a_small_bytes"], m["a2a_small_s"], m["a2a_large_bytes"],
                               m["a2a_large_s"])
    p2p_bw, p2p_lat = fit_link(m["p2p_small_bytes"], m["p2p_small_s"], m["p2p_large_bytes"],
                               m["p2p_large_s"])
    fwd_flops = 4 * PROBE[0] ** 2 * PROBE[1] * 64 / 2  # causal: half the square, as in the model
    tf, tfb = m["kernel_fwd_s"], m["kernel_fb_s"]
    causal_rate = 3.5 * fwd_flops / tfb
    full_rate = 3.5 * 4 * PROBE_NC[0] ** 2 * PROBE_NC[1] * 64 / m["kernel_nc_s"]
    return dict(a2a_bw=a2a_bw, a2a_lat_s=a2a_lat, p2p_bw=p2p_bw, p2p_lat_s=p2p_lat,
                merge_bw=m["merge_bytes"] / m["merge_s"], kernel_flops=causal_rate,
                kernel_fwd_flops=fwd_flops / tf, bwd_over_fwd=(tfb - tf) / tf,
                kernel_nc_flops=full_rate,
                causal_tile=causal_tile_from_rates(PROBE[0], causal_rate, full_rate),
                overlap=m["overlap"], nprocs=n, threads=threads)


def overlap_share(kernel_s: list, comm_s: list, both_s: list) -> float:
    """Share of the shorter of (kernel, transfer) hidden when both run at once, per
    repetition (the three were timed back to back), median over repetitions, in [0, 1]."""
    shares = [(c + x - b) / min(c, x) for c, x, b in zip(kernel_s, comm_s, both_s)]
    return min(1.0, max(0.0, _median(shares)))


def evaluate(args, res: dict, stat: str) -> dict:
    """Calibrate, predict and compare, summarizing every repeated time with ``STATS[stat]``."""
    f, rounds = STATS[stat], res["rounds"]
    m = {k: f(v) if isinstance(v, list) else v for k, v in res["micro"].items()}
    m["overlap"] = overlap_share(*(res["micro"][k] for k in ("ovl_kernel_s", "ovl_comm_s",
                                                            "ovl_both_s")))
    m["kernel_fwd_s"] = f(rounds["kernel fwd"])
    m["kernel_fb_s"] = f(rounds["kernel fwd+bwd"])
    m["kernel_nc_s"] = f(rounds["kernel fwd+bwd non-causal"])
    cal = summarize_micro(m, args.nprocs, args.threads)
    spec = calibrated_spec(load_cluster("cpu_local"), cal)
    local_spec = spec.replace(ranks_per_node=args.nprocs, nodes=1)  # all ranks on this one host
    # the prototype counts FLOPs at the unmasked rate and charges the diagonal separately
    proto_spec = local_spec.replace(mfu=min(1.0, cal["kernel_nc_flops"] / spec.peak_flops))
    proto_kw = dict(overlap=cal["overlap"], causal_tile=cal["causal_tile"])
    shape0 = dict(batch=args.batch, heads=args.heads, kv_heads=args.kv_heads,
                  head_dim=args.head_dim, dtype_bytes=4, causal=True)
    rows, orders = [], []
    for L in args.seq_lens:
        shape = Shape(seq_len=L, **shape0)
        meas, pred, proto, comp, per_round = {}, {}, {}, {}, {}
        for u, r in args.layouts:
            name = f"u={u} r={r}"
            full, loc = rounds[f"usp L={L} {name}"], rounds[f"local L={L} {name}"]
            p = predict_attention(local_spec, shape, u, r, args.balance)
            row = dict(L=L, config=name, measured_s=f(full), compute_s=f(loc),
                       pred_s=p["fwd_bwd"], pred_compute_s=p["compute"] + p["merge"],
                       pred_comm_s=p["a2a"] + p["ring_exposed"],
                       proto_s=proposed_attention(proto_spec, shape, u, r, args.balance,
                                                  **proto_kw))
            row["rest_s"] = row["measured_s"] - row["compute_s"]
            rows.append(row)
            meas[name], pred[name], proto[name] = row["measured_s"], row["pred_s"], row["proto_s"]
            comp[name], per_round[name] = row["compute_s"], full
        agree, resolved, pairs = pairwise_agreement(per_round, pred)
        mo, po, qo = ranking(meas), ranking(pred), ranking(proto)
        orders.append(dict(L=L, measured=mo, predicted=po, proto=qo, compute_only=ranking(comp),
                           agree=agree, proto_agree=pairwise_agreement(per_round, proto)[0],
                           resolved=resolved, pairs=pairs))
    summary = {}
    for key, label in (("pred_s", "model"), ("proto_s", "proto")):
        ratios = [r[key] / r["measured_s"] for r in rows]
        same = sum(o["measured"] == o["predicted" if label == "model" else "proto"] for o in orders)
        summary[label] = dict(min=min(ratios), median=_median(ratios), max=max(ratios),
                              same_order=same, lengths=len(orders))
    return dict(stat=stat, micro=m, calibration=cal, spec=spec, rows=rows, orders=orders,
                summary=summary)


def _summary_lines(ev: dict) -> list[str]:
    out = []
    for label, s in ev["summary"].items():
        out.append(f"{label}/measured ({ev['stat']} of rounds) over {len(ev['rows'])} calls: "
                   f"min {s['min']:.3f}, median {s['median']:.3f}, max {s['max']:.3f}; same order "
                   f"as measured at {s['same_order']} of {s['lengths']} lengths")
    return out


def report(args, res: dict) -> dict:
    ev = evaluate(args, res, args.stat)
    other = evaluate(args, res, "median" if args.stat == "min" else "min")
    m, cal, n = ev["micro"], ev["calibration"], args.nprocs
    print(f"\n== this machine: {n} gloo processes x {args.threads} thread(s), "
          f"{os.cpu_count()} CPUs; {args.stat} over repetitions ==")
    print(f"all_to_all_single  small {m['a2a_small_s'] * 1e3:7.3f} ms ({m['a2a_small_bytes']} B "
          f"sent/rank), large {m['a2a_large_s'] * 1e3:7.2f} ms ({m['a2a_large_bytes'] / 2**20:.1f} "
          f"MiB) -> {cal['a2a_bw'] / 1e9:.3f} GB/s per rank, latency "
          f"{cal['a2a_lat_s'] * 1e3:.3f} ms")
    print(f"P2P ring step      small {m['p2p_small_s'] * 1e3:7.3f} ms ({m['p2p_small_bytes']} B), "
          f"large {m['p2p_large_s'] * 1e3:7.2f} ms ({m['p2p_large_bytes'] / 2**20:.1f} MiB) -> "
          f"{cal['p2p_bw'] / 1e9:.3f} GB/s per rank, latency {cal['p2p_lat_s'] * 1e3:.3f} ms")
    print(f"LSE merge          {m['merge_s'] * 1e3:.2f} ms for [1, 2048, 8, 64] -> "
          f"{cal['merge_bw'] / 1e9:.2f} GB/s as the model counts it (3 fp32 passes)")
    print(f"attention kernel   [1, {PROBE[0]}, {PROBE[1]}, 64] causal fp32, all ranks at once: "
          f"fwd {m['kernel_fwd_s'] * 1e3:.1f} ms, fwd+bwd {m['kernel_fb_s'] * 1e3:.1f} ms -> "
          f"{cal['kernel_flops'] / 1e9:.2f} GFLOP/s per rank (fwd alone "
          f"{cal['kernel_fwd_flops'] / 1e9:.2f}); bwd/fwd time {cal['bwd_over_fwd']:.2f} "
          f"(model FLASH_BWD 2.5)")
    print(f"                   [1, {PROBE_NC[0]}, {PROBE_NC[1]}, 64] non-causal fwd+bwd "
          f"{m['kernel_nc_s'] * 1e3:.1f} ms -> {cal['kernel_nc_flops'] / 1e9:.2f} GFLOP/s; "
          f"causal diagonal waste = {cal['causal_tile']:.0f} tokens")
    print(f"overlap            kernel {m['ovl_kernel_s'] * 1e3:.1f} ms, transfer "
          f"{m['ovl_comm_s'] * 1e3:.1f} ms, both {m['ovl_both_s'] * 1e3:.1f} ms -> "
          f"{cal['overlap']:.0%} of the shorter one hidden (median of paired repetitions; "
          f"the model assumes 100%)")
    print("\nconfigs/cluster/cpu_local.yaml (measured fields; mfu = causal kernel rate / "
          "peak_flops):")
    print(yaml_lines(ev["spec"]))

    print(f"\n== attention fwd+bwd: B={args.batch} H={args.heads}/{args.kv_heads} "
          f"d={args.head_dim} causal fp32 {args.balance}; {args.stat} of {args.iters} rounds, "
          f"slowest rank; model on the calibrated spec, {n} ranks on one host ==")
    print("meas = usp_attention; compute = the same ring, no transfers, no all-to-all; "
          "rest = meas - compute;\npred = usp.planner.cost.estimate (compute = FLOPs + merges, "
          "comm = all-to-all + exposed ring); proto = proposed_attention")
    head = (f"{'L':>5} {'config':<9} {'meas ms':>8} {'compute':>8} {'rest':>7} | {'pred ms':>8} "
            f"{'compute':>8} {'comm':>6} | {'pred/meas':>9} {'compute':>7} {'comm':>6} | "
            f"{'proto ms':>8} {'/meas':>6}")
    print(head)
    print("-" * len(head))
    for L in args.seq_lens:
        for row in (x for x in ev["rows"] if x["L"] == L):
            rest = row["rest_s"]
            print(f"{L:>5} {row['config']:<9} {row['measured_s'] * 1e3:8.1f} "
                  f"{row['compute_s'] * 1e3:8.1f} {rest * 1e3:7.1f} | {row['pred_s'] * 1e3:8.1f} "
                  f"{row['pred_compute_s'] * 1e3:8.1f} {row['pred_comm_s'] * 1e3:6.1f} | "
                  f"{row['pred_s'] / row['measured_s']:9.3f} "
                  f"{row['pred_compute_s'] / row['compute_s']:7.3f} "
                  f"{row['pred_comm_s'] / rest if rest > 0 else float('nan'):6.2f} | "
                  f"{row['proto_s'] * 1e3:8.1f} {row['proto_s'] / row['measured_s']:6.3f}")
        o = next(x for x in ev["orders"] if x["L"] == L)
        mo, po, qo = o["measured"], o["predicted"], o["proto"]
        print(f"{'':>5} order: measured {' < '.join(mo)} | compute-only "
              f"{' < '.join(o['compute_only'])}")
        print(f"{'':>5}        model    {' < '.join(po)} ({'same' if mo == po else 'differs'})"
              f" | proto {' < '.join(qo)} ({'same' if mo == qo else 'differs'})")
        print(f"{'':>5} pairs with the same winner in every round: {o['resolved']}/{o['pairs']}; "
              f"model agrees on {o['agree']}/{o['resolved']}, proto on "
              f"{o['proto_agree']}/{o['resolved']}")
    print()
    print("\n".join(_summary_lines(ev) + _summary_lines(other)))
    strip = lambda e: {k: (asdict(v) if k == "spec" else v) for k, v in e.items()}  # noqa: E731
    return {args.stat: strip(ev), other["stat"]: strip(other)}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nprocs", type=int, default=4)
    p.add_argument("--seq-lens", type=lambda s: tuple(int(x) for x in s.split(",")), default=None,
                   help=f"global lengths, comma-separated (default {FULL['seq_lens']})")
    p.add_argument("--layouts", default="4x1,2x2,1x4", help="ULYSSESxRING, comma-separated")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=None, help="default: --heads")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--balance", choices=("zigzag", "contiguous"), default="zigzag")
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--iters", type=int, default=None, help="timed rounds")
    p.add_argument("--threads", type=int, default=None, help="default: CPUs // nprocs, >= 1")
    p.add_argument("--a2a-kib", type=int, default=4096, help="large all-to-all: KiB per peer")
    p.add_argument("--p2p-kib", type=int, default=16384, help="large ring step: KiB sent")
    p.add_argument("--stat", choices=sorted(STATS), default="min",
                   help="how repeated times are summarized (default min: load only adds time)")
    p.add_argument("--overlap-reps", type=int, default=7, help="rounds of the overlap test")
    p.add_argument("--quick", action="store_true", help=f"smoke test: {QUICK}")
    p.add_argument("--published-only", action="store_true", help="no measurement")
    p.add_argument("--json", type=Path, default=None, help="write all results here")
    args = p.parse_args(argv)
    for key, val in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, val)
    args.kv_heads = args.kv_heads or args.heads
    if args.threads is None:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        args.threads = max(1, (cpus or 1) // args.nprocs)
    try:
        args.layouts = [tuple(int(x) for x in item.lower().split("x"))
                        for item in args.layouts.split(",")]
        for u, r in args.layouts:
            if u * r != args.nprocs:
                raise ValueError(f"layout {u}x{r} does not use all {args.nprocs} processes")
            check_heads(args.heads, args.kv_heads, u)
            for L in args.seq_lens:
                if L % seq_multiple(u, r, args.balance):
                    raise ValueError(f"seq_len {L} is not a multiple of "
                                     f"{seq_multiple(u, r, args.balance)} for layout {u}x{r}")
    except ValueError as e:
        p.error(str(e))
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    out = {}
    if not args.published_only:
        with tempfile.TemporaryDirectory() as tmp:
            raw = os.path.join(tmp, "raw.json")
            t0, load0 = time.perf_counter(), os.getloadavg()[0]
            spawn_local(run_rank, args.nprocs, args, raw, threads=args.threads)
            res = json.loads(Path(raw).read_text())
            res["loadavg"] = [load0, os.getloadavg()[0]]
        out = report(args, res)
        out["raw"], out["wall_s"] = res, time.perf_counter() - t0
        print(f"(measured in {out['wall_s']:.0f} s; 1-minute load average {res['loadavg'][0]:.1f} "
              f"before, {res['loadavg'][1]:.1f} after, on {os.cpu_count()} CPUs)")
    rows = published_rows()
    print("\n== published figures vs the model (relative figures; specs: published_specs()) ==")
    print(format_published(rows))
    print("\nsources:\n  " + "\n  ".join((RFA_SOURCE, USP_ISSUE40, USP_README, USP_ISSUE73)))
    if args.json:
        out["published"] = rows
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2, default=str))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
