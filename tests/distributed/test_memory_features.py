"""Memory features in the trainer at (ulysses, ring) = (2, 2): chunked loss, tiled MLP,
selective checkpoints and the state offload train exactly as without them (one spawn of 4
ranks for all cases).

The state offload (``trainer.state_offload``) runs through its CPU stand-in
(``_state_offload.train_as_cuda``): FSDP2's ``CPUOffloadPolicy`` on every ``fully_shard``,
whose parameters FSDP marks as offloaded (asserted), the gradient norm on its host-memory
path (``clip_grad_norm(host=True)``); the run stops after step 1 and resumes from its
checkpoint (the offloaded state saved and loaded by DCP)."""

import json
from pathlib import Path

from usp.config import LoggingConfig, ModelConfig, OptimConfig, ParallelConfig, RecallData, \
    TrainerConfig
from usp.launch import spawn_local
from usp.train.phase_runner import RunConfig

from _state_offload import shard_calls, train_as_cuda

STEPS = 2
CASES = {
    "off": ({}, {}),
    # chunks that do not divide the 2 x 32 tokens of a rank; blocks 0 and 2 recompute attention
    "attention": (dict(loss_chunk=40, mlp_tiles=3),
                  dict(activation_checkpointing=True, checkpoint_every=2,
                       checkpoint_part="attention")),
    # every block recomputes its MLP, itself tiled: checkpoints nested under FSDP2
    "mlp": (dict(loss_chunk=7, mlp_tiles=2),
            dict(activation_checkpointing=True, checkpoint_part="mlp")),
    "state": ({}, {"state_offload": True}),  # the stand-in, see the module docstring
}


def _cfg(run_dir: str, model_kw: dict, trainer_kw: dict) -> RunConfig:
    return RunConfig(
        model=ModelConfig(vocab_size=320, dim=64, n_layers=3, n_heads=4, n_kv_heads=2,
                          ffn_dim=128, **model_kw),
        parallel=ParallelConfig(ulysses_degree=2, ring_degree=2, ranks_per_node=2),
        data=RecallData(seq_len=128, batch_per_dp_rank=2, n_pairs=8, n_queries=8,
                        eval_batches=1),
        optim=OptimConfig(lr=3e-3, warmup_steps=2),
        trainer=TrainerConfig(steps=STEPS, run_dir=run_dir, nprocs=4, **trainer_kw),
        logging=LoggingConfig(wandb="disabled", jsonl=True, plot=False, progress=False),
    )


def _train_cases(root: str) -> None:
    for name, (model_kw, trainer_kw) in CASES.items():
        if name == "state":  # checkpointed after step 1 and resumed (DCP of host state)
            train_as_cuda(_cfg(str(Path(root, name)), model_kw, {**trainer_kw, "stop_after": 1}))
        train_as_cuda(_cfg(str(Path(root, name)), model_kw, trainer_kw))


def test_memory_features_train_exactly_as_without(tmp_path):
    spawn_local(_train_cases, 4, str(tmp_path))
    runs, evals = {}, {}
    for name in CASES:
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        runs[name] = [json.loads(ln) for ln in lines]
        evals[name] = json.loads((tmp_path / name / "summary.json").read_text())["eval_acc"]
    off = runs.pop("off")
    assert [r["step"] for r in off] == list(range(1, STEPS + 1))
    for name, recs in runs.items():
        assert [r["step"] for r in recs] == list(range(1, STEPS + 1)), name
        for a, b in zip(off, recs):
            for key in ("loss", "grad_norm"):
                assert abs(a[key] - b[key]) <= 1e-5 * abs(a[key]), (name, a["step"], key)
            assert a["acc"] == b["acc"], (name, a["step"])  # answer accuracy from predictions
        assert evals[name] == evals["off"], name  # held-out accuracy (no grad)
    assert off[-1]["loss"] < off[0]["loss"]  # and it trains
    for name in CASES:  # three blocks and the root on every rank; offloaded in "state" only
        want = ("CPUOffloadPolicy", True) if name == "state" else ("OffloadPolicy", False)
        for rank in range(4):
            assert shard_calls(tmp_path / name, rank) == [want] * 4, (name, rank)
