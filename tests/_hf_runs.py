"""The small usp-train run of a transformers model (``model.hf``) that the HF training tests
configure (``unit/test_hf_train.py``, ``distributed/test_hf_train_ranks.py``)."""

from usp.config import (LoggingConfig, ModelConfig, OptimConfig, ParallelConfig, RecallData,
                        RunConfig, TrainerConfig)

QUIET = LoggingConfig(wandb="disabled", jsonl=True, plot=False, progress=False)
MODEL = ModelConfig(hf="llama", dim=64, n_heads=4, n_kv_heads=2, ffn_dim=128)


def small_cfg(run_dir, u=2, r=2, steps=6, model=MODEL, **trainer_kw) -> RunConfig:
    return RunConfig(
        model=model,
        parallel=ParallelConfig(ulysses_degree=u, ring_degree=r, ranks_per_node=u),
        data=RecallData(seq_len=128, batch_per_dp_rank=2, n_pairs=8, n_queries=8,
                        eval_batches=1),
        optim=OptimConfig(lr=3e-3, warmup_steps=2),
        trainer=TrainerConfig(steps=steps, run_dir=str(run_dir), nprocs=u * r, **trainer_kw),
        logging=QUIET,
    )
