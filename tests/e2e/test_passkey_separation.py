"""Passkey retrieval separates a trained model from fresh weights: 1-digit ``--exact``
passkey documents -> usp-prepare -> usp-train (recipe passkey_tiny_cpu: a tiny byte model at
128 tokens, 16 rows a step, on the recipe's one CPU rank) scoring the passkey grid at step 0
(fresh weights) and at its last step. Trained: at least 0.9 of the cases at every depth;
fresh: near chance (1/9). Measured in docs/eval.md#a-model-that-retrieves-1-digit-keys."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

BIN = Path(sys.executable).parent  # the venv's console scripts
ROOT = Path(__file__).resolve().parents[2]
STEPS = 700  # retrieval forms between steps 450 and 600 (accuracy 1.0 at 600)


def _run(*argv, timeout=900):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD"))}
    env["OMP_NUM_THREADS"] = "1"
    r = subprocess.run([str(a) for a in argv], capture_output=True, text=True,
                       timeout=timeout, cwd=ROOT, env=env)
    assert r.returncode == 0, (argv, r.stdout[-2000:], r.stderr[-3000:])
    return r


def test_trained_model_retrieves_fresh_weights_do_not(tmp_path):
    _run(sys.executable, "-m", "tools.passkey_corpus", "--out", tmp_path / "src", "--docs",
         "4000", "--chars", "128", "--exact", "--digits", "1", "--seed", "1")
    prefix = tmp_path / "pk128"
    _run(BIN / "usp-prepare", "--src", tmp_path / "src", "--glob", "*.jsonl", "--out", prefix,
         "--no-eos", "--val-fraction", "0.02", "--workers", "1", "--quiet")
    run = tmp_path / "run"
    _run(BIN / "usp-train", "recipe=passkey_tiny_cpu", f"data.path={prefix}",
         f"trainer.run_dir={run}", f"hydra.run.dir={tmp_path / 'hydra'}",
         f"trainer.steps={STEPS}", f"trainer.eval_every={STEPS}",
         "trainer.ckpt_every=0", "eval.during_training=true", "eval.key_digits=1",
         "eval.depths=[0,0.25,0.5,0.75,1]", "eval.per_cell=4", "logging=none",
         "logging.jsonl=true")

    scored = {r["step"]: r for r in map(json.loads, (run / "metrics.jsonl").open())
              if "passkey_acc/128" in r}
    assert sorted(scored) == [0, STEPS]
    fresh, trained = scored[0], scored[STEPS]
    assert fresh["passkey_acc/128"] <= 0.25 and fresh["passkey_logprob/128"] < -4.0
    assert trained["passkey_logprob/128"] > -0.5  # log(1/9) = -2.2: chance among digits
    last = json.loads((run / "passkey.json").read_text())  # the last validation's grid
    assert last["lengths"] == [128] and last["chance"] == 1 / 9
    assert min(last["accuracy"][0]) >= 0.9, last["accuracy"]  # every depth
    assert trained["passkey_acc/128"] >= 0.9
