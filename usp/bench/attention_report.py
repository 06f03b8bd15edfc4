"""The result of one ``usp.bench.attention`` run: the JSON-ready dict (``results``) and its
table as text (``format_report``), including the usp / peer ratios per ``a2a_chunks``."""

from __future__ import annotations

import os
import platform
from dataclasses import asdict
import torch

from .attention_setup import AttentionBench, Row
from .timing import time_ratios


def results(bench: AttentionBench, rows: list[Row], skip: str | None,
            peer_version: str | None = None) -> dict:
    """The JSON-ready result of one run (see ``run_rank``)."""
    ds = next((r for r in rows if r.kind == "peer"), None)
    ds_stats = ds.stats() if ds else None
    out_rows = []
    for row in rows:
        s = row.stats()
        ratio = s["mean_ms"] / ds_stats["mean_ms"] if ds else None
        out_rows.append({**asdict(row), **s, "ratio_to_peer": ratio})
    args = {**asdict(bench), "layouts": [f"{u}x{r}" for u, r in bench.layouts],
            "peer": None if ds is None else ds.name}
    env = dict(torch=torch.__version__, python=platform.python_version(),
               cpus=os.cpu_count(), threads_per_proc=bench.threads)
    if peer_version is not None:
        env["peer"] = peer_version
    n = bench.nprocs
    by_chunks = {}
    for pure in (r for r in rows if r.kind == "usp" and r.ulysses == n and r.ring == 1):
        if ds is None:
            break
        by_chunks[pure.variant] = dict(time_ratios(pure.times_ms, ds.times_ms),
                                       a2a_exposed_share=pure.stats()["a2a_exposed_share"])
    return dict(args=args, env=env, rows=out_rows, peer_skipped=skip,
                usp_over_peer=next(iter(by_chunks.values()), None),
                usp_over_peer_by_chunks=by_chunks or None)


def format_report(result: dict) -> str:
    """The table ``results`` describes, as text."""
    a = result["args"]
    lines = ["", f"attention fwd+bwd: B={a['batch']} L={a['seq_len']} Hq={a['heads']} "
                 f"Hkv={a['kv_heads']} d={a['head_dim']} causal={a['causal']} "
                 f"dtype={a['dtype']} balance={a['balance']} nprocs={a['nprocs']} "
                 f"threads/proc={a['threads']} iters={a['iters']} "
                 f"(max over ranks per iteration)"]
    head = (f"{'config':<26} {'mean ms':>10} {'std ms':>9} {'min ms':>10} {'median ms':>10} "
            f"{'vs peer':>7} {'max|diff|':>10} {'a2a exp':>8} {'a2a hid':>8} {'exp %':>6} "
            f"{'cpu ms':>7}")
    lines += [head, "-" * len(head)]
    for r in result["rows"]:
        ratio = r["ratio_to_peer"]
        rtxt = f"{ratio:7.3f}" if ratio is not None else f"{'-':>7}"
        a2a = (f" {r['a2a_exposed_mean_ms']:8.1f} {r['a2a_hidden_mean_ms']:8.1f} "
               f"{100 * r['a2a_exposed_share']:6.1f}" if r.get("a2a_exposed_share") is not None
               else f" {'-':>8} {'-':>8} {'-':>6}")
        cpu = r.get("cpu_mean_ms")
        lines.append(f"{r['name']:<26} {r['mean_ms']:10.1f} {r['std_ms']:9.1f} "
                     f"{r['min_ms']:10.1f} {r['median_ms']:10.1f} {rtxt} "
                     f"{r['max_abs_diff']:10.2e}{a2a} "
                     + (f"{cpu:7.1f}" if cpu is not None else f"{'-':>7}"))
    n, by_chunks = a["nprocs"], result.get("usp_over_peer_by_chunks")
    peer = (a.get("peer") or "peer").split(" ")[0]
    if by_chunks:
        lines.append("")
        for c, ratios in by_chunks.items():
            lines.append(f"usp(u={n}, {c}) / {peer}(u={n}) = {ratios['mean']:.3f} "
                         f"(mean); {ratios['median']:.3f} (median); {ratios['min']:.3f} (min); "
                         f"{ratios['paired_median']:.3f} (median of per-round ratios)")
    elif result["peer_skipped"] is not None:
        lines.append(f"\nno peer row ({result['peer_skipped']}); no ratio")
    return "\n".join(lines)
