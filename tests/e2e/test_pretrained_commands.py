"""usp-train model=pretrained model.pretrained=DIR at (ulysses, ring) = (2, 2), for tiny
Llama (llama3 scaling), Qwen2 (biases, windowed layers) and Mistral (a window) checkpoints
saved by transformers: step 0's val_loss is transformers' mean loss on the same windows
(with the checkpoint's RoPE, a raised rope_theta, YaRN), a few steps train, and bad
checkpoints are refused before any rank starts, printed once, with nothing written."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from _cli import run_commands
from _export_runs import corpus
from _pretrained import KINDS, hf_logits, save_checkpoint

L = 32
YARN = "{rope_type:yarn,factor:4,original_max_position_embeddings:8}"
# name -> (checkpoint, overrides, transformers' rope_parameters: None = the checkpoint's)
RUNS = {kind: (kind, [], None) for kind in KINDS}
RUNS["llama_yarn"] = ("llama", ["model.rope_theta=2000000", f"model.rope_scaling={YARN}"],
                      {"rope_theta": 2e6, "rope_type": "yarn", "factor": 4.0,
                       "original_max_position_embeddings": 8})


def _args(root: Path, name: str, ckpt: Path, extra=()) -> list[str]:
    return ["recipe=tiny_cpu", "model=pretrained", f"model.pretrained={ckpt}", "data=memmap",
            f"data.path={root / 'corpus'}", f"data.seq_len={L}", "data.batch_per_dp_rank=2",
            "parallel.ulysses_degree=2", "parallel.ring_degree=2", "trainer.steps=2",
            "trainer.eval_every=2", "trainer.eval_windows=4", "optim.warmup_steps=1",
            "logging.wandb=disabled", "logging.plot=false", f"trainer.run_dir={root / name}",
            f"hydra.run.dir={root / 'hydra' / name}", *extra]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("pretrained")
    ckpts = {k: save_checkpoint(k, root / "ckpt" / k) for k in KINDS}
    corpus(root / "corpus", 4096)
    corpus(Path(f"{root / 'corpus'}.val"), 1024)
    calls = [("train_main", _args(root, name, ckpts[k], extra))
             for name, (k, extra, _) in RUNS.items()]
    return root, ckpts, dict(zip(RUNS, run_commands(calls, root, timeout=900)))


def _hf_val_loss(root: Path, ckpt: Path, rope) -> float:
    """transformers' mean loss per target on the validation split's first 4 windows."""
    from usp.config import MemmapData
    from usp.data.dataset import build_validation
    from usp.models.pretrained import pretrained_config

    data = MemmapData(path=str(root / "corpus"), seq_len=L, batch_per_dp_rank=2)
    (_, _, val), = build_validation(data, pretrained_config(ckpt), 4)
    b = val.model_windows(np.arange(4), torch.arange(L))
    logits = hf_logits(ckpt, b.tokens, rope)
    return F.cross_entropy(logits.flatten(0, 1), b.labels.flatten(), ignore_index=-100).item()


@pytest.mark.parametrize("name", RUNS)
def test_step_0_val_loss_is_transformers_and_the_run_trains(runs, name):
    root, ckpts, res = runs
    r = res[name]
    assert r.returncode == 0, r.stderr[-3000:]
    recs = [json.loads(x) for x in (root / name / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in recs] == [0, 1, 2]
    kind, _, rope = RUNS[name]
    want = _hf_val_loss(root, ckpts[kind], rope)
    assert recs[0]["val_loss"] == pytest.approx(want, rel=1e-4)
    assert "step=0 val_loss=" in r.stdout
    assert all(np.isfinite(x["loss"]) for x in recs[1:])
    if name == "llama_yarn":
        assert "rope_theta 500000 -> 2e+06" in r.stdout
