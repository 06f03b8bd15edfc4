"""Benchmark figures published by ring-flash-attn and USP (yunchang), beside the cost model.

The figures and their sources are in ``RFA`` and ``USP_*``, the hardware specs in
``published_specs()``; ``published_rows()`` sets each figure beside the model's figure for
the same setup (``usp.planner.calibration.predict_attention``).
"""

from __future__ import annotations

from .calibration import AttentionShape, predict_attention
from ..config.cluster import load_cluster
from .cost import FLASH_BWD

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
SOURCES = (RFA_SOURCE, USP_ISSUE40, USP_README, USP_ISSUE73)


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
    one = AttentionShape(batch=1, seq_len=8192, heads=32, kv_heads=8, head_dim=128,
                         dtype_bytes=2)
    ring8 = AttentionShape(batch=1, seq_len=8 * 8192, heads=32, kv_heads=8, head_dim=128,
                           dtype_bytes=2)
    for (gpu, mode), fig in RFA.items():
        spec = specs[gpu]
        key = mode.replace("+", "_")  # "fwd" or "fwd_bwd"
        solo = predict_attention(spec.replace(ranks_per_node=1), one, 1, 1)[key]
        for impl, bal in (("zigzag_ring", "zigzag"), ("ring_attn", "contiguous")):
            t = predict_attention(spec, ring8, 1, 8, bal)[key]
            rows.append(dict(source="ring-flash-attn", hw=f"8x{gpu}",
                             what=f"{impl} {mode}: rate / (flash_attn rate / 8)",
                             published=fig[impl] / (fig["flash"] / 8), model=8 * solo / t))
        rows.append(dict(source="ring-flash-attn", hw=f"1x{gpu}",
                         what=f"flash_attn {mode} iter/s (absolute, 8192 tok)",
                         published=fig["flash"], model=1 / solo))
    for gpu in ("H800", "A100"):
        f, fb = RFA[(gpu, "fwd")]["flash"], RFA[(gpu, "fwd+bwd")]["flash"]
        rows.append(dict(source="ring-flash-attn", hw=f"1x{gpu}", what="flash_attn bwd time / "
                         "fwd time", published=f / fb - 1, model=FLASH_BWD))
    a100 = specs["A100"]
    for local in (16384, 8192):  # USP issue 40 profiles both lengths without saying which one is timed
        sh = AttentionShape(batch=2, seq_len=8 * local, heads=8, kv_heads=8, head_dim=128,
                            dtype_bytes=2)
        uly = predict_attention(a100, sh, 8, 1)["fwd"]
        for impl, bal in (("basic", "contiguous"), ("zigzag", "zigzag")):
            ring = predict_attention(a100, sh, 1, 8, bal)["fwd"]
            rows.append(dict(source="USP issue 40", hw="8xA100? NVLink",
                             what=f"fwd ring({impl}) / ulysses, 8 ranks, {local} tok/rank",
                             published=100 / 60,
                             model=ring / uly,
                             note="published is a lower bound (> 100 ms / ~60 ms)"))
    for name in ("L20", "L20 2x4"):
        spec = specs[name]
        for local in (4096, 32768):
            sh = AttentionShape(batch=1, seq_len=8 * local, heads=32, kv_heads=8, head_dim=128,
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
    """``published_rows()`` as a table: published figure, model figure, their ratio."""
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
