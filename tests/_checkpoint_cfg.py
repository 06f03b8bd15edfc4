"""The run config whose fingerprint the checkpoint tests save and compare
(``unit/test_checkpoint_resume.py``, ``distributed/test_checkpoint_files.py``)."""

from dataclasses import replace

from usp.config import MemmapData, RecallData, ModelConfig, OptimConfig, ParallelConfig, TrainerConfig
from usp.train.trainer import RunConfig


def run_cfg(u=2, r=2, **over) -> RunConfig:
    cfg = RunConfig(
        model=ModelConfig(vocab_size=320, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128),
        parallel=ParallelConfig(ulysses_degree=u, ring_degree=r),
        data=RecallData(seq_len=128, batch_per_dp_rank=2),
        optim=OptimConfig(lr=3e-3, warmup_steps=2),
        trainer=TrainerConfig(steps=6, nprocs=u * r),
    )
    for section, fields in over.items():
        if fields.get("kind") == "memmap":  # another dataset: another config type
            cfg.data = MemmapData(path="corpus", seq_len=cfg.data.seq_len)
            continue
        setattr(cfg, section, replace(getattr(cfg, section), **fields))
    return cfg
