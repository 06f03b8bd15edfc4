"""Time usp-prepare against Hugging Face datasets (load_dataset + Dataset.map) on one corpus.

    python -m tools.bench_prepare                              # 200 MB, workers 1 and 2
    python -m tools.bench_prepare --corpus-mb 20 --json /tmp/bench_prepare.json
    python -m tools.bench_prepare --only usp --corpus-mb 4000 --workers 2   # memory bound

The corpus (JSONL made from the standard library's source, from ``--seed``) and the
tokenizer (a byte-level BPE trained on its first ``--sample-mb``) are made under
``--work-dir`` and reused by later runs of the same size and seed. What is measured and how:
``tools.lab.prepare_bench``. Exits with status 1 when the token files of the runs differ.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tools.lab.prepare_bench import TOOLS, PrepareBench, as_json, run
from tools.lab.prepare_report import report, rows


def _parser() -> argparse.ArgumentParser:
    d = PrepareBench()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--corpus-mb", type=float, default=d.corpus_mb,
                   help=f"JSONL corpus size in MB (default {d.corpus_mb:g})")
    p.add_argument("--workers", default=",".join(map(str, d.workers)),
                   help="worker counts, comma separated (default 1,2)")
    p.add_argument("--rounds", type=int, default=d.rounds, help="interleaved rounds (median)")
    p.add_argument("--work-dir", type=Path, default=d.work_dir,
                   help=f"corpus, tokenizer and run outputs (default {d.work_dir})")
    p.add_argument("--only", choices=TOOLS, default=None, help="run one tool only")
    p.add_argument("--keep", action="store_true",
                   help="keep each run's output files (token files, datasets' cache) under "
                        "WORK_DIR/runs; the corpus and tokenizer are always kept")
    p.add_argument("--seed", type=int, default=d.seed, help="of the generated corpus")
    p.add_argument("--vocab", type=int, default=d.vocab, help="BPE vocabulary, EOS included")
    p.add_argument("--sample-mb", type=float, default=d.sample_mb,
                   help=f"corpus MB the tokenizer is trained on (default {d.sample_mb:g})")
    p.add_argument("--timeout", type=float, default=None, help="seconds per run at most")
    p.add_argument("--tokenizer", choices=("bpe", "bytes"), default=d.tokenizer,
                   help="bytes: usp's byte tokenizer (with --only usp), e.g. for the memory "
                        "bound on a corpus of several GB")
    p.add_argument("--json", type=Path, default=None, help="write the figures to this file")
    return p


def parse_args(argv=None) -> tuple[PrepareBench, argparse.Namespace]:
    p = _parser()
    args = p.parse_args(argv)
    try:
        workers = tuple(int(w) for w in args.workers.split(","))
    except ValueError:
        p.error(f"--workers {args.workers!r}: give counts separated by commas, e.g. 1,2")
    try:  # refuse before anything is generated
        cfg = PrepareBench(corpus_mb=args.corpus_mb, workers=workers, rounds=args.rounds,
                           work_dir=args.work_dir, seed=args.seed, vocab=args.vocab,
                           tools=(args.only,) if args.only else TOOLS,
                           sample_mb=args.sample_mb, keep=args.keep, timeout_s=args.timeout,
                           tokenizer=args.tokenizer)
    except ValueError as e:
        p.error(str(e))
    return cfg, args


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    cfg, args = parse_args(argv)
    try:
        result = run(cfg)
    except RuntimeError as e:
        print(f"bench_prepare: {e}", file=sys.stderr)
        return 1
    table = rows(result)
    print()
    print(report(result, table))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(as_json(result, table, argv), indent=1) + "\n")
        print(f"figures written to {args.json}")
    return 0 if result.agree else 1


if __name__ == "__main__":
    sys.exit(main())
