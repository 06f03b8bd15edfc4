"""Check usp's CUDA paths on one GPU and write a JSON report and a readable summary.

    PYTHONPATH=. python tools/gpu_check.py --out runs/gpu_check     # on a GPU, < 8 minutes
    python tools/gpu_check.py --dry-run                             # same code, CPU, tiny shapes

Needs only torch and usp's own modules (no Hydra, OmegaConf, wandb or flash-attn). Exit code
0 when every check passes, 1 otherwise. What each section checks: usp/bench/gpu_check.py.
"""

import argparse
import json
import sys
from pathlib import Path

from usp.bench.gpu_check import SECTIONS, run, summarize


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes (for CI)")
    ap.add_argument("--out", default="runs/gpu_check", help="folder for report.json, summary.txt")
    ap.add_argument("--sections", default=",".join(SECTIONS),
                    help=f"comma-separated subset of {','.join(SECTIONS)}")
    args = ap.parse_args()
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
