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


def checkpointed_model(cfg: RunConfig, run, mesh, layout):
    """(model, optimizer, schedule) of a finished run, on every rank of ``mesh``: the model
    built and FSDP-sharded as the trainer builds it (the built-in one or ``model.hf``'s),
    its weights loaded from the run's newest checkpoint (the optimizer and schedule only
    hold the checkpoint's other entries)."""
    from functools import partial

    import torch

    from usp.attention import usp_attention
    from usp.models.checkpoint import latest_checkpoint, load_checkpoint
    from usp.models.decoder import Transformer
    from usp.models.routed import routed_model
    from usp.train.build import shard_model

    if cfg.model.hf is None:
        attn = partial(usp_attention, mesh=mesh, layout=layout, causal=True,
                       **run.attention_options())
        model = Transformer(cfg.model, attn)
        blocks = model.layers
    else:
        model, blocks, _ = routed_model(cfg.model, mesh, run.attention_options(),
                                        cfg.trainer.seed, layout,
                                        checkpoint_activations=cfg.trainer.activation_checkpointing)
    shard_model(model, mesh.submesh("dp_sp"), "fp32", blocks)
    opt = torch.optim.AdamW(model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    load_checkpoint(latest_checkpoint(cfg.trainer.run_dir), model, opt, sched)
    return model, opt, sched
