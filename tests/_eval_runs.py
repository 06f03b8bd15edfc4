"""What the usp-eval tests score (``unit/test_eval_passkey.py``,
``distributed/test_eval_ranks.py``): byte-token files with a validation split, and the
config of a tiny run on them."""

from dataclasses import replace
from pathlib import Path

import numpy as np

from usp.config import (EvalConfig, MemmapData, ModelConfig, OptimConfig, ParallelConfig,
                        RunConfig, TrainerConfig)
from usp.data.files import TokenWriter

from _hf_runs import QUIET

MODEL = ModelConfig(vocab_size=257, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64,
                    rope_theta=10000.0, norm_eps=1e-6, tie_embeddings=False)
WORDS = "the quick brown fox jumps over a lazy dog while rivers run to the sea".split()


def byte_corpus(prefix: Path, n_bytes: int = 6000, val_bytes: int = 3000) -> Path:
    """``prefix.bin`` and its validation split ``prefix.val.bin`` of random words, byte
    tokens (as ``usp-prepare --tokenizer bytes`` writes them); returns ``prefix``."""
    rng = np.random.default_rng(0)
    for path, n in ((prefix, n_bytes), (prefix.with_name(prefix.name + ".val"), val_bytes)):
        text = " ".join(rng.choice(WORDS, n // 4)).encode()[:n]
        with TokenWriter(path, vocab_size=257, tokenizer="bytes+eos", source="test") as w:
            w.write(np.frombuffer(text, dtype=np.uint8).astype(np.int64))
    return prefix


def run_cfg(run_dir: Path, prefix: Path, u: int = 1, r: int = 1, steps: int = 2,
            **eval_keys) -> RunConfig:
    """A tiny built-in model on the byte corpus at seq_len 128 (``steps`` steps), with
    ``eval`` set to ``eval_keys`` (3-digit keys, depths 0, 0.5, 1, 2 cases a cell)."""
    keys = dict(lengths=[128, 256], depths=[0.0, 0.5, 1.0], per_cell=2, key_digits=3,
                windows=2, buckets=4)
    return RunConfig(model=MODEL, parallel=ParallelConfig(ulysses_degree=u, ring_degree=r),
                     data=MemmapData(path=str(prefix), seq_len=128, batch_per_dp_rank=2),
                     optim=OptimConfig(lr=1e-2, warmup_steps=1),
                     trainer=TrainerConfig(steps=steps, run_dir=str(run_dir), nprocs=u * r),
                     logging=QUIET, eval=EvalConfig(**{**keys, **eval_keys}))


def at(cfg: RunConfig, u: int, r: int, **eval_keys) -> RunConfig:
    """``cfg`` at degrees (u, r) on u x r ranks, ``eval`` keys replaced."""
    return replace(cfg, parallel=replace(cfg.parallel, ulysses_degree=u, ring_degree=r),
                   trainer=replace(cfg.trainer, nprocs=u * r),
                   eval=replace(cfg.eval, **eval_keys))
