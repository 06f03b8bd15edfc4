"""The GPU check: every CUDA path of usp on one GPU, against fp64 dense attention.

    python -m usp.bench.gpu_check --out runs/gpu_check     # on a GPU, < 8 minutes
    python -m usp.bench.gpu_check --dry-run                # same code, CPU, tiny shapes

Writes ``report.json`` and ``summary.txt`` under ``--out``; exit code 0 when every check
passes, 1 otherwise. From a checkout with another torch (a GPU machine's), run it with
``PYTHONPATH=.``.

Sections, each a list of rows (dicts with ``ok``):

1. ``kernels``: the ``torch`` kernel's forward and backward vs fp64 math;
2. ``ring``: the ring's block plan and merge on the real kernels, over threads;
3. ``usp_attention``: 4 processes sharing the GPU over gloo, three layouts, GQA, fp32/bf16;
4. ``training``: the trainer on one GPU: the loss falls, the metrics are in range;
5. ``throughput``: our kernel path vs bare SDPA, and a 1B-class model's MFU.

Sections 1-3 and their tolerances: ``gpu_checks_attention.py``; 4-5:
``gpu_checks_training.py``. This module holds the shapes, the runner and the summary.
``dry_run=True`` runs the same code on the CPU with tiny shapes (CI keeps it from rotting).
Imports only torch and usp (no Hydra, OmegaConf, wandb or flash-attn).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
import platform
import time

import torch

from .gpu_sizes import Sizes  # noqa: F401 (the check's shapes)
from .gpu_checks_attention import check_kernels, check_ring, check_usp_attention
from .gpu_checks_experts import check_experts
from .gpu_checks_training import check_throughput, check_training


# ---- the whole check ----------------------------------------------------------------------
SECTIONS = {
    "kernels": check_kernels,
    "ring": check_ring,
    "usp_attention": check_usp_attention,
    "experts": check_experts,
    "training": check_training,
    "throughput": check_throughput,
}


def environment(device: torch.device) -> dict:
    env = dict(torch=torch.__version__, python=platform.python_version(), device=str(device))
    if device.type == "cuda":
        env.update(gpu=torch.cuda.get_device_name(0), cuda=torch.version.cuda,
                   gpus=torch.cuda.device_count())
    return env


def run(dry_run: bool = False, sections=None, log=print) -> dict:
    """Run the named sections (all by default); returns the report (``ok`` overall)."""
    if not dry_run and not torch.cuda.is_available():
        raise ValueError("the GPU check needs CUDA; on a CPU run it with --dry-run")
    device = torch.device("cpu" if dry_run else "cuda", None if dry_run else 0)
    sizes = Sizes.dry() if dry_run else Sizes()
    names = list(SECTIONS) if sections is None else list(sections)
    unknown = [n for n in names if n not in SECTIONS]
    if unknown:
        raise ValueError(f"unknown sections {unknown}; choose from {list(SECTIONS)}")
    report = dict(env=environment(device), dry_run=dry_run, sections={}, seconds={})
    for name in names:
        t0 = time.perf_counter()
        rows = SECTIONS[name](device, sizes)
        report["sections"][name] = rows
        report["seconds"][name] = round(time.perf_counter() - t0, 1)
        bad = sum(not r["ok"] for r in rows)
        log(f"[{name}] {len(rows) - bad}/{len(rows)} ok in {report['seconds'][name]} s")
    report["ok"] = all(r["ok"] for rows in report["sections"].values() for r in rows)
    return report


def summarize(report: dict) -> str:
    """A readable summary: per section the worst error against its bound, or the figures."""
    lines = [f"usp GPU check ({'dry run, CPU' if report['dry_run'] else 'CUDA'}): "
             + ", ".join(f"{k}={v}" for k, v in report["env"].items())]
    for name, rows in report["sections"].items():
        bad = [r for r in rows if not r["ok"]]
        lines.append(f"\n## {name}: {len(rows) - len(bad)}/{len(rows)} ok "
                     f"({report['seconds'][name]} s)")
        if name in ("kernels", "ring", "usp_attention"):
            for dtype in ("float32", "bfloat16"):
                sel = [r for r in rows if r["dtype"] == dtype]
                if not sel:
                    continue
                worst = {n: max(r["err"][n] for r in sel) for n in sel[0]["err"]}
                key = "naive_err" if name == "kernels" else "single_err"
                base = {n: max(r[key][n] for r in sel) for n in sel[0][key]}
                lines.append(f"  {dtype}: max error " + ", ".join(
                    f"{n} {worst[n]:.2e} (baseline {base[n]:.2e})" for n in worst))
        else:
            lines.extend("  " + json.dumps({k: v for k, v in r.items()}) for r in rows)
        lines.extend("  FAILED " + json.dumps(r) for r in bad if name != "training"
                     and name != "throughput")
    lines.append(f"\noverall: {'PASS' if report['ok'] else 'FAIL'}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes (for CI)")
    ap.add_argument("--out", default="runs/gpu_check", help="folder for report.json, summary.txt")
    ap.add_argument("--sections", default=",".join(SECTIONS),
                    help=f"comma-separated subset of {','.join(SECTIONS)}")
    args = ap.parse_args(argv)
    report = run(dry_run=args.dry_run, sections=args.sections.split(","))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    text = summarize(report)
    (out / "summary.txt").write_text(text + "\n")
    print(text)
    print(f"report: {out.resolve() / 'report.json'}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
