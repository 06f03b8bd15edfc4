"""A user's whole journey with their own text: a JSONL corpus with bad lines and a BPE
tokenizer directory -> usp-prepare -> usp-train on 2x2 with model.vocab_size=auto ->
usp-export -> transformers loads model and tokenizer, scores held-out text and generates.
Bad input at each step gets one clear error."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from _tokenizers import bpe, jsonl_corpus, save_dir, texts
from usp.data.sources import in_validation

pytest.importorskip("transformers")
BIN = Path(sys.executable).parent  # the venv's console scripts
ROOT = Path(__file__).resolve().parents[2]


def _run(*argv, timeout=600, env=None):
    env = {k: v for k, v in (env or os.environ).items() if not k.startswith(("RANK", "WORLD"))}
    return subprocess.run([str(BIN / argv[0]), *map(str, argv[1:])], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT, env=env)


def _train_args(prefix, run, tmp_path, *extra):
    return ["data=memmap", f"data.path={prefix}", "data.seq_len=128", "data.batch_per_dp_rank=2",
            "logging.wandb=disabled", "logging.progress=false", "logging.plot=false",
            "logging.jsonl=true", f"trainer.run_dir={run}", f"hydra.run.dir={tmp_path / 'hydra'}",
            *extra]


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("journey")
    docs = texts(800, seed=11, lo=20, hi=80)
    src = jsonl_corpus(tmp / "corpus", docs)  # 3 bad lines and a blank one in part-0.jsonl
    tok = save_dir(bpe(vocab_size=300, corpus=texts(300, seed=2)), tmp / "tokenizer")
    prefix = tmp / "data" / "corpus"
    r = _run("usp-prepare", "--src", src, "--glob", "*.jsonl", "--out", prefix, "--tokenizer",
             tok, "--val-fraction", "0.1", "--quiet")
    assert r.returncode == 0, r.stderr
    return tmp, docs, prefix, r.stdout


def test_corpus_to_tokens_to_a_model_transformers_runs(prepared):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp, docs, prefix, out = prepared
    assert "line skipped, not JSON: 1 (e.g. part-0.jsonl:3 " in out
    assert "line skipped, no key 'text' (--text-key): 1 (e.g. part-0.jsonl:4 " in out
    meta = json.loads(Path(f"{prefix}.json").read_text())
    assert meta["val"]["num_documents"] > 0 and meta["num_documents"] + \
        meta["val"]["num_documents"] == len(docs)

    run = tmp / "run"
    r = _run("usp-train", *_train_args(prefix, run, tmp, "model.vocab_size=auto",
                                       "parallel.ulysses_degree=2", "parallel.ring_degree=2",
                                       "trainer.nprocs=4", "trainer.steps=40", "optim.lr=3e-3",
                                       "optim.warmup_steps=5"))
    assert r.returncode == 0, r.stderr[-3000:]
    losses = [json.loads(line)["loss"] for line in (run / "metrics.jsonl").open()]
    assert len(losses) == 40 and losses[-1] < losses[0] - 1.0  # it learns the corpus
    assert (run / "tokenizer" / "tokenizer.json").is_file()  # the data's tokenizer, kept

    out_dir = tmp / "hf"
    r = _run("usp-export", run, out_dir)
    assert r.returncode == 0 and r.stderr == "", r.stderr[-3000:]
    from usp.config import ModelConfig

    n = ModelConfig(vocab_size=meta["vocab_size"]).num_params()  # the tiny shape, tied
    assert r.stdout.splitlines() == [
        f"usp-export: wrote LlamaForCausalLM ({n:,} parameters, float32) from "
        f"{run}/checkpoints/step_000040 to {out_dir}",
        f"usp-export: tokenizer: copied from {run}/tokenizer"]

    model = AutoModelForCausalLM.from_pretrained(out_dir).eval()
    tok = AutoTokenizer.from_pretrained(out_dir)
    assert model.config.vocab_size == len(tok) == meta["vocab_size"]
    # held-out text: the documents usp-prepare put in the validation split
    # (part-0.jsonl's lines 3-6 hold the bad lines and the blank one)
    names = [f"part-0.jsonl:{i + 1 if i < 2 else i + 5}" for i in range(400)]
    names += [f"part-1.jsonl:{i + 1}" for i in range(400)]
    held_out = [d for d, n in zip(docs, names) if in_validation(n, 0.1)]
    assert held_out
    ids = tok(" ".join(held_out[:8]), return_tensors="pt").input_ids[:, :256]
    with torch.no_grad():
        loss = model(ids, labels=ids).loss.item()
    assert math.isfinite(loss) and loss < 0.75 * math.log(len(tok))  # well under uniform
    prompt = tok("the cat sat", return_tensors="pt")
    gen = model.generate(**prompt, max_new_tokens=8, do_sample=False)
    assert gen.shape[1] > prompt.input_ids.shape[1]
    assert isinstance(tok.decode(gen[0]), str)


def test_bad_input_at_each_step_one_error(prepared):
    tmp, _, prefix, _ = prepared
    # a model smaller than the data's vocabulary: both numbers, before any rank starts
    r = _run("usp-train", *_train_args(prefix, tmp / "small", tmp, "model.vocab_size=100",
                                       "trainer.nprocs=1", "parallel.ulysses_degree=1",
                                       "parallel.ring_degree=1", "parallel.ranks_per_node=null"))
    err = [line for line in r.stderr.splitlines() if "error" in line]
    assert r.returncode == 2 and len(err) == 1, r.stderr[-2000:]
    meta = json.loads(Path(f"{prefix}.json").read_text())
    assert f"vocab_size {meta['vocab_size']} > model.vocab_size 100" in err[0]
    assert f"set model.vocab_size={meta['vocab_size']}" in err[0]
    assert not (tmp / "small" / "checkpoints").exists()
    # the same under torchrun: every task refuses before the rendezvous, one message
    if shutil.which("torchrun"):
        t0 = time.perf_counter()
        r = subprocess.run(
            ["torchrun", "--standalone", "--nproc-per-node", "2", "-m", "usp.cli",
             *_train_args(prefix, tmp / "small2", tmp, "model.vocab_size=100",
                          "parallel.ulysses_degree=1", "parallel.ring_degree=2",
                          "parallel.ranks_per_node=null")],
            capture_output=True, text=True, cwd=ROOT, timeout=300,
            env={k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD"))})
        assert r.returncode != 0
        assert r.stderr.count("usp-train: error:") == 1, r.stderr[-3000:]
        assert f"vocab_size {meta['vocab_size']} > model.vocab_size 100" in r.stderr
        assert time.perf_counter() - t0 < 60
    # a run that never wrote a checkpoint cannot be exported; nothing is written
    (tmp / "empty_run").mkdir()
    r = _run("usp-export", tmp / "empty_run", tmp / "never")
    assert r.returncode == 2 and r.stderr.startswith("usp-export: error:"), r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and not (tmp / "never").exists()
