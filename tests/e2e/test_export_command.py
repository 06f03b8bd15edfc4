"""usp-export as a user runs it: usp-train (one rank, two steps) on token files that carry a
tokenizer, then the installed ``usp-export`` command: what it prints (nothing on stderr)
and the directory transformers loads."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from usp.config import ModelConfig

from _export_runs import TEXT, corpus

pytest.importorskip("transformers")
BIN = Path(sys.executable).parent  # the venv's console scripts


def _run(*argv, timeout=300):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run([str(BIN / argv[0]), *map(str, argv[1:])], capture_output=True,
                          text=True, env=env, timeout=timeout)


def test_usp_train_then_usp_export(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = corpus(tmp_path / "data" / "corpus")
    run, out = tmp_path / "run", tmp_path / "hf"
    train = _run("usp-train", "data=memmap", f"data.path={tmp_path / 'data' / 'corpus'}",
                 "data.seq_len=64", "data.batch_per_dp_rank=2", "model.vocab_size=96",
                 "parallel.ulysses_degree=1", "parallel.ring_degree=1",
                 "parallel.ranks_per_node=null", "trainer.nprocs=1", "trainer.steps=2",
                 "logging.wandb=disabled", "logging.progress=false", "logging.plot=false",
                 f"trainer.run_dir={run}", f"hydra.run.dir={tmp_path / 'hydra'}")
    assert train.returncode == 0, train.stderr[-3000:]

    done = _run("usp-export", run, out)
    n = ModelConfig(vocab_size=96).num_params()  # the tiny default shape, tied embeddings
    assert done.returncode == 0 and done.stderr == "", done.stderr[-3000:]
    assert done.stdout.splitlines() == [
        f"usp-export: wrote LlamaForCausalLM ({n:,} parameters, float32) from "
        f"{run}/checkpoints/step_000002 to {out}",
        f"usp-export: tokenizer: copied from {run}/tokenizer"]
    assert AutoTokenizer.from_pretrained(out)(TEXT[0]).input_ids == tok(TEXT[0]).input_ids
    assert AutoModelForCausalLM.from_pretrained(out).config.eos_token_id == tok.eos_token_id
