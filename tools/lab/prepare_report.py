"""The table of ``tools.bench_prepare``: the median of each row over its rounds, and usp's
figures divided by datasets' at the same worker count (below 1: usp takes less)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from statistics import median

from .prepare_bench import ENV, Result, in_process

MIB = 2**20
LABELS = {"usp": "usp-prepare", "datasets map": "datasets -> arrow cache",
          "datasets": "datasets -> .bin"}


@dataclass
class Row:
    """The median of one tool at one worker count: ``what`` is ``usp``, ``datasets map``
    (until the mapped dataset is done) or ``datasets`` (until the flat file is written);
    ``usp_*``: usp's median divided by this row's (None on usp's rows)."""

    what: str
    workers: int
    seconds: float
    tokens: int
    peak_rss_mib: float
    peak_pss_mib: float
    peak_anon_mib: float
    rounds: int
    usp_time: float | None = None
    usp_rss: float | None = None
    usp_pss: float | None = None

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


def rows(result: Result) -> list[Row]:
    out = []
    for w in result.bench.workers:
        usp = None
        for tool in result.bench.tools:
            runs = [s for s in result.samples if s.tool == tool and s.workers == w]
            if not runs:
                continue
            phases = [("datasets map", "map_")] if tool == "datasets" else []
            for what, prefix in [*phases, (tool, "")]:
                mid = {k: median(getattr(s, prefix + k) for s in runs)
                       for k in ("seconds", "peak_rss", "peak_pss", "peak_anon")}
                row = Row(what, w, mid["seconds"], runs[0].tokens, mid["peak_rss"] / MIB,
                          mid["peak_pss"] / MIB, mid["peak_anon"] / MIB, len(runs))
                if tool == "usp":
                    usp = row
                elif usp is not None:
                    row.usp_time = usp.seconds / row.seconds
                    row.usp_rss = usp.peak_rss_mib / row.peak_rss_mib
                    row.usp_pss = usp.peak_pss_mib / row.peak_pss_mib
                out.append(row)
    return out


def report(result: Result, table: list[Row]) -> str:
    c, b = result.corpus, result.bench
    tokens = result.samples[0].tokens
    title = ("usp-prepare vs Hugging Face datasets" if "datasets" in b.tools else
             "usp-prepare alone (--only usp)")
    lines = [f"{title}: {c['mb']:.1f} MB of JSONL in {c['files']} "
             f"files, {c['documents']:,} documents, {tokens:,} tokens; "
             f"{result.tokenizer['kind']} vocab {result.tokenizer['vocab_size']}",
             f"{' '.join(f'{k}={v}' for k, v in ENV.items() if k.startswith('TOKENIZERS'))} on "
             "both sides: N workers = N processes, no tokenizer threads; seconds = the whole "
             "command (start-up included)",
             "peak memory summed over the process tree, sampled every 0.1 s: RSS (VmRSS), PSS "
             "(shared pages split among their processes: a forked pool's counted once), anon "
             "(RssAnon: without file-backed pages such as mapped arrow files)",
             f"median of {b.rounds} round(s), rows interleaved; usp/datasets: usp's figure "
             "divided by the row's (< 1: usp takes less)", ""]
    head = (f"{'tool':<24} {'workers':>7} {'seconds':>8} {'tokens/s':>11} {'peak RSS MiB':>12} "
            f"{'PSS MiB':>8} {'anon MiB':>8}  usp/datasets")
    lines += [head, "-" * len(head)]
    for r in table:
        ratio = ("" if r.usp_time is None else
                 f"time {r.usp_time:.2f}, RSS {r.usp_rss:.2f}, PSS {r.usp_pss:.2f}")
        note = " *" if r.what == "usp" and in_process(result, r.workers) else ""
        lines.append(f"{LABELS[r.what] + note:<24} {r.workers:>7} {r.seconds:>8.1f} "
                     f"{r.tokens_per_s:>11,.0f} {r.peak_rss_mib:>12.0f} {r.peak_pss_mib:>8.0f} "
                     f"{r.peak_anon_mib:>8.0f}"
                     f"  {ratio}")
    if any(in_process(result, w) for w in b.workers) and "usp" in b.tools:
        lines.append("* usp-prepare ran in one process: a corpus under 8 MB ignores --workers")
    lines.append("")
    lines += _checks(result)
    lo = result.load_avg
    lines.append(f"machine: {os.cpu_count()} CPUs, load average (1, 5, 15 min) "
                 f"{_load(lo.get('before'))} before, {_load(lo.get('after'))} after")
    return "\n".join(lines)


def _load(avg) -> str:
    return "?" if avg is None else "/".join(f"{x:.1f}" for x in avg)


def _checks(result: Result) -> list[str]:
    first = result.samples[0]
    if result.agree:
        tools = " and ".join(sorted({s.tool for s in result.samples}))
        return [f"check: every run ({tools}) wrote the same {first.tokens:,} tokens of "
                f"{first.documents:,} documents, token files byte-identical "
                f"(blake2b {first.digest})"]
    lines = [f"MISMATCH: token files differ from the first run's ({first.tool} "
             f"w{first.workers}: {first.tokens:,} tokens, {first.documents:,} documents):"]
    lines += [f"  {s.tool} w{s.workers} round {s.round + 1}: {s.difference}"
              for s in result.samples if not s.same]
    return lines
