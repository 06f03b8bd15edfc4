"""The usp-prepare command: workers give the same bytes, bad input gets one line and exit 2."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from _tokenizers import bpe, save_dir, texts
from usp.data.prepare import POOL_BYTES

pytest.importorskip("tokenizers")
PREPARE = [sys.executable, "-m", "usp.data.prepare"]


def _run(*args, **kw):
    return subprocess.run([*PREPARE, *map(str, args)], capture_output=True, text=True,
                          timeout=300, **kw)


def test_two_workers_write_the_same_bytes_as_one(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    docs = texts(2000, seed=5, lo=50, hi=400)
    size = 0
    for part in range(4):  # > POOL_BYTES in all, so --workers 2 starts its pool
        with open(src / f"p{part}.jsonl", "w") as f:
            while size < (part + 1) * (POOL_BYTES // 4 + 200_000):
                line = json.dumps({"text": docs[size % len(docs)]}) + "\n"
                f.write(line)
                size += len(line)
    tok = save_dir(bpe(), tmp_path / "tok")
    outs = {}
    for workers in (1, 2):
        out = tmp_path / f"w{workers}" / "c"
        r = _run("--src", src, "--glob", "*.jsonl", "--out", out, "--tokenizer", tok,
                 "--workers", workers, "--val-fraction", 0.05)
        assert r.returncode == 0, r.stderr
        assert "documents from 4 files" in r.stdout and "val:" in r.stdout
        assert "usp-prepare:" in r.stderr and "tokens=" in r.stderr  # the progress bar
        outs[workers] = out
    for name in ("c.bin", "c.json", "c.docs", "c.val.bin", "c.val.json", "c.val.docs",
                 "c.tokenizer/tokenizer.json"):
        a, b = (outs[w].parent / name for w in (1, 2))
        assert a.read_bytes() == b.read_bytes(), name


def test_bad_input_one_line_exit_2_nothing_written(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.jsonl").write_text(json.dumps({"body": "x"}) + "\n")
    out = tmp_path / "out" / "c"
    cases = [
        (["--tokenizer", tmp_path / "missing"], r"tokenizer '.*missing' not found"),
        (["--glob", "*.jsonl"], r"no documents in the 1 files .*no key 'text'.*--text-key"),
        (["--glob", "*.none"], r"no files under .* match the pattern '\*\.none'"),
        (["--glob", "*.jsonl", "--text-key", "body", "--strict", "--val-fraction", "2"],
         r"val_fraction=2.0 must lie in \[0, 1\)"),
    ]
    for extra, pattern in cases:
        r = _run("--src", src, "--out", out, "--quiet", *extra)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1, r.stderr
        assert lines[0].startswith("usp-prepare: error: ")
        assert re.search(pattern, lines[0]), lines[0]
    assert not out.parent.exists() or not list(out.parent.iterdir())
