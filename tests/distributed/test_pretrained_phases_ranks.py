"""``model=pretrained`` in length phases on 2 ranks: the checkpoint's safetensors are read
once, by the fresh run's first phase; a later phase and a restart take every weight from
the run's own checkpoint (``usp.train.build.sharded_model(from_checkpoint=True)``), and
train as the straight run does, bit for bit."""

import json
from pathlib import Path

import torch.distributed as dist

from usp.config import LoggingConfig, ParallelConfig, PhaseConfig, RecallData, RunConfig, \
    TrainerConfig
from usp.launch import spawn_local
from usp.models.pretrained import pretrained_config
from usp.run import resolve_phases
from usp.train.phase_runner import train

from _pretrained import save_checkpoint


def _cfg(ckpt: Path, run_dir: Path, **trainer) -> RunConfig:
    """Two phases on 2 ranks: 32 tokens on dp 2, then 64 tokens on ulysses 2."""
    phases = [PhaseConfig(seq_len=32, steps=2), PhaseConfig(seq_len=64, steps=2, ulysses_degree=2)]
    return RunConfig(
        model=pretrained_config(ckpt),
        parallel=ParallelConfig(ulysses_degree=1, ring_degree=1, ranks_per_node=2),
        data=RecallData(seq_len=32, batch_per_dp_rank=1, n_pairs=2, n_queries=2),
        trainer=TrainerConfig(steps=4, run_dir=str(run_dir), nprocs=2, device="cpu",
                              phases=phases, **trainer),
        logging=LoggingConfig(wandb="disabled", jsonl=True, plot=False, progress=False))


def _runs(root: str, runs: dict) -> None:
    """Each run in turn; rank r writes how often it read the safetensors to reads_r.json."""
    import usp.train.build as build

    real, reads = build.load_shards, {}

    def counted(*args, **kw):
        reads[name] = reads.get(name, 0) + 1
        return real(*args, **kw)

    build.load_shards = counted
    try:
        for name, plan in runs.items():
            train(plan.cfg, plan)
            dist.barrier()
    finally:
        build.load_shards = real
    Path(root, f"reads_{dist.get_rank()}.json").write_text(json.dumps(reads))


def _losses(run_dir: Path) -> dict:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {rec["step"]: rec["loss"] for rec in map(json.loads, lines) if "loss" in rec}


def test_the_pretrained_weights_are_read_once_and_phases_resume_from_checkpoints(tmp_path):
    ckpt = save_checkpoint("llama", tmp_path / "hf")
    runs = {name: resolve_phases(_cfg(ckpt, tmp_path / run_dir, **trainer), 2, "cpu")
            for name, run_dir, trainer in (("straight", "straight", {}),
                                           ("stopped", "restarted", {"stop_after": 3}),
                                           ("restarted", "restarted", {}))}
    assert [(p.run.dp, p.run.ulysses) for p in runs["straight"].phases] == [(2, 1), (1, 2)]
    spawn_local(_runs, 2, str(tmp_path), runs)
    for rank in (0, 1):
        # a fresh run reads them in its first phase only; the restart (mid phase 2) never
        reads = json.loads((tmp_path / f"reads_{rank}.json").read_text())
        assert reads == {"straight": 1, "stopped": 1}, (rank, reads)
    straight, restarted = _losses(tmp_path / "straight"), _losses(tmp_path / "restarted")
    assert sorted(straight) == sorted(restarted) == [1, 2, 3, 4]
    assert restarted == straight  # phase 2 and the restart start from the checkpoints' weights
