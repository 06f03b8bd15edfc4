"""``python -m tools.bench_prepare`` as a command on a tiny corpus: both sides (usp-prepare
and Hugging Face datasets) write the same tokens, and the figures it reports are measured
ones. The benchmark's peer is not in the dev extra, so CI skips this (the measurement stays
out of CI); ``pip install -e '.[bench]'`` brings it."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_bench_prepare_tiny_corpus_agrees_and_measures(tmp_path):
    pytest.importorskip("tokenizers")
    pytest.importorskip("transformers")
    pytest.importorskip("datasets")
    out = tmp_path / "figures.json"
    cmd = [sys.executable, "-m", "tools.bench_prepare", "--corpus-mb", "1", "--workers", "1",
           "--vocab", "512", "--sample-mb", "1", "--work-dir", str(tmp_path / "work"),
           "--json", str(out), "--timeout", "120"]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    figures = json.loads(out.read_text())

    samples = figures["samples"]
    assert [s["tool"] for s in samples] == ["usp", "datasets"]
    tokens = {s["tool"]: s["tokens"] for s in samples}
    assert tokens["usp"] > 0
    assert len(set(tokens.values())) == 1  # the same count on both sides
    assert figures["agree"] and all(s["same"] for s in samples)  # and the same token files
    assert len({s["digest"] for s in samples}) == 1
    assert figures["corpus"]["tokens"] == tokens["usp"]
    assert figures["corpus"]["documents"] == samples[0]["documents"] > 0
    assert figures["tokenizer"]["vocab_size"] == 512
    assert figures["env"]["TOKENIZERS_PARALLELISM"] == "false"
    for row in figures["rows"]:
        assert row["peak_rss_mib"] > 0 and row["peak_pss_mib"] > 0
        assert row["tokens_per_s"] > 0 and row["seconds"] > 0
    mapped = [r for r in figures["rows"] if r["what"] == "datasets map"]
    assert len(mapped) == 1 and 0 < mapped[0]["seconds"] <= samples[1]["seconds"]
    assert "check: every run" in res.stdout and "MISMATCH" not in res.stdout
    assert not (tmp_path / "work" / "runs").exists()  # run outputs removed without --keep
