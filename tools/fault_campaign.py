"""Hit real usp-train runs with faults and print what happened: fault | what happened | steps lost | verdict.

    python -m tools.fault_campaign                     # every scenario, ~4 min on 2 cores
    python -m tools.fault_campaign --only sigterm,diverge

Each scenario is a ``python -m usp.cli`` run on 4 local gloo ranks (ulysses 2 x ring 2, 24
steps, a checkpoint every 6); see tools/lab/faults.py for what each injects and checks.
"""

import argparse
import sys
import tempfile

from tools.lab.faults import SCENARIOS, campaign, format_table


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--only", default=",".join(SCENARIOS),
                    help=f"comma-separated subset of {','.join(SCENARIOS)}")
    ap.add_argument("--workdir", default=None, help="keep the runs here (default: a temp dir)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rows = campaign(args.workdir or tmp, args.only.split(","), log=lambda s: print(s, flush=True))
    print()
    print(format_table(rows))
    return 0 if all(r.ok for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
