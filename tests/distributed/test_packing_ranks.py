"""Packed documents and sliding windows across ulysses x ring (2, 2): the model equals one
process and its documents run alone, and a short packed-recall training run learns."""

from __future__ import annotations

import functools
import json

import torch
import torch.distributed as dist

from usp.config import (
    LoggingConfig, ModelConfig, OptimConfig, ParallelConfig, RecallData, RunConfig, TrainerConfig,
)
from usp.data.packing import document_positions
from usp.layout import SequenceLayout
from usp.models.decoder import Transformer

from _packed import LOCAL, MODEL, documents_alone, packed_row


def _sp_worker(run_dir):
    """(2, 2) SP model vs one process (packed, windows) and vs documents alone; then a
    packed recall run that learns."""
    from usp import SPMesh, usp_attention
    from usp.train.phase_runner import train

    L = 64
    tokens, ids = packed_row([9, 20, 1, 6, 28], MODEL["vocab_size"], seed=1)
    tokens, ids = tokens.repeat(2, 1), ids.repeat(2, 1)
    ids[1] = torch.cat([torch.zeros(40), torch.ones(24)]).long()  # rows pack differently
    pos = document_positions(ids)
    with SPMesh.build(ulysses=2, ring=2, ranks_per_node=2) as mesh:
        for balance in ("zigzag", "contiguous"):
            lay = SequenceLayout(mesh, seq_len=L, balance=balance)
            sp = functools.partial(usp_attention, mesh=mesh, layout=lay, causal=True)
            for window in (None, 6, 40):
                cfg = ModelConfig(**MODEL, rope="per_document", sliding_window=window)
                one = Transformer(cfg, LOCAL)
                want = one(tokens, pos, ids)
                got = lay.gather(Transformer(cfg, sp)(lay.shard(tokens), lay.shard(pos),
                                                      lay.shard(ids)))
                assert (got - want).abs().max() <= 1e-4, (balance, window)
                if window is None:
                    assert (got[:1] - documents_alone(one, tokens[:1], ids[:1])).abs().max() <= 1e-4
    cfg = RunConfig(
        model=ModelConfig(vocab_size=320, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                          ffn_dim=128, rope="per_document"),
        parallel=ParallelConfig(ranks_per_node=2),
        data=RecallData(seq_len=256, batch_per_dp_rank=4, n_pairs=4, n_queries=4,
                        documents_per_row=4, packing="documents", eval_batches=1),
        optim=OptimConfig(lr=3e-3, warmup_steps=3),
        trainer=TrainerConfig(steps=20, run_dir=run_dir, nprocs=4, ckpt_every=0),
        logging=LoggingConfig(wandb="disabled", jsonl=True, plot=False, progress=False),
    )
    summary = train(cfg)
    assert 0.0 <= summary["eval_acc"] <= 1.0
    dist.barrier()


def test_packed_model_across_ranks_and_training(tmp_path):
    from usp.launch import spawn_local

    spawn_local(_sp_worker, 4, str(tmp_path))
    hist = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [h["step"] for h in hist] == list(range(1, 21))
    first = sum(h["loss"] for h in hist[:3]) / 3
    last = sum(h["loss"] for h in hist[-3:]) / 3
    assert last < 0.6 * first, (first, last)
