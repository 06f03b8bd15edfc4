"""Training app: layout-independent losses, resume, crash-safe checkpoints, memmap data."""

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from usp.config import MemmapData, RecallData, LoggingConfig, ModelConfig, OptimConfig, ParallelConfig, TrainerConfig
from usp.launch import spawn_local
from usp.train.trainer import RunConfig, train

QUIET = LoggingConfig(wandb="disabled", jsonl=True, plot=False, progress=False)


def small_cfg(run_dir, u=2, r=2, steps=5, **trainer_kw) -> RunConfig:
    return RunConfig(
        model=ModelConfig(vocab_size=320, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128),
        parallel=ParallelConfig(ulysses_degree=u, ring_degree=r, ranks_per_node=max(u, 1)),
        data=RecallData(seq_len=128, batch_per_dp_rank=2, n_pairs=8, n_queries=8),
        optim=OptimConfig(lr=3e-3, warmup_steps=2),
        trainer=TrainerConfig(steps=steps, run_dir=str(run_dir), nprocs=u * r, **trainer_kw),
        logging=QUIET,
    )


def _run(cfg: RunConfig):
    spawn_local(train, cfg.trainer.nprocs, cfg)
    lines = (Path(cfg.trainer.run_dir) / "metrics.jsonl").read_text().splitlines()
    return {rec["step"]: rec for rec in map(json.loads, lines)}


def test_same_losses_1x1_and_2x2(tmp_path):
    one = _run(small_cfg(tmp_path / "a", u=1, r=1))
    four = _run(small_cfg(tmp_path / "b", u=2, r=2))
    assert sorted(one) == sorted(four) == [1, 2, 3, 4, 5]
    for s in one:
        a, b = one[s]["loss"], four[s]["loss"]
        assert abs(a - b) <= 1e-4 * abs(a), (s, a, b)
    assert one[5]["loss"] < one[1]["loss"]  # and it learns
    for rec in four.values():  # a per-step peak where Linux allows resetting it
        assert rec["peak_mem_kind"] in ("rss_step", "rss_since_start") and rec["peak_mem_mb"] > 0
        assert rec["attn_comm_clock"] == "host" and 0 < rec["attn_comm_share"] < 1  # gloo


LAYOUTS = [(4, 1), (1, 4)]  # (ulysses, ring) a (2, 2) checkpoint resumes under


def test_resume_matches_uninterrupted_and_across_layouts(tmp_path):
    straight = _run(small_cfg(tmp_path / "straight", steps=6))
    # interrupted at step 3 (checkpoint written) under (ulysses, ring) = (2, 2)
    _run(small_cfg(tmp_path / "resumed", steps=6, stop_after=3))
    assert (tmp_path / "resumed" / "checkpoints" / "step_000003").is_dir()
    # copies of that run directory resume under the other layouts
    for u, r in LAYOUTS:
        shutil.copytree(tmp_path / "resumed", tmp_path / f"re_{u}x{r}")
    # another init seed: only the checkpoint can give the straight run's losses
    resumed = _run(small_cfg(tmp_path / "resumed", steps=6, seed=7))
    for s in (4, 5, 6):
        assert abs(resumed[s]["loss"] - straight[s]["loss"]) <= 1e-6 * straight[s]["loss"], s
    for u, r in LAYOUTS:
        moved = _run(small_cfg(tmp_path / f"re_{u}x{r}", u=u, r=r, steps=6, seed=7))
        for s in (4, 5, 6):
            a, b = straight[s]["loss"], moved[s]["loss"]
            assert abs(a - b) <= 1e-4 * a, (u, r, s, a, b)


def _crash_worker(run_dir):
    from torch.distributed.fsdp import fully_shard

    import usp.train.checkpoint as ck

    model = torch.nn.Linear(4, 4)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    ck.save_checkpoint(run_dir, 1, model, opt, sched)
    before = {k: v.full_tensor().clone() for k, v in model.state_dict().items()}
    real = ck.dcp.save

    def crash(state, checkpoint_id):
        real(state, checkpoint_id=checkpoint_id)  # shards written, then the job dies
        raise RuntimeError("simulated crash during save")

    ck.dcp.save = crash
    with pytest.raises(RuntimeError, match="simulated crash"):
        with torch.no_grad():
            model.weight.add_(1.0)
        ck.save_checkpoint(run_dir, 2, model, opt, sched)
    ck.dcp.save = real
    dist.barrier()
    latest = ck.latest_checkpoint(run_dir)
    assert latest is not None and latest.name == "step_000001", latest
    ck.load_checkpoint(latest, model, opt, sched)
    for k, v in model.state_dict().items():
        assert torch.equal(v.full_tensor(), before[k]), k
    ck.save_checkpoint(run_dir, 3, model, opt, sched)  # the next save clears the debris
    assert not list((Path(run_dir) / "checkpoints").glob("*.tmp"))


def test_crash_during_save_keeps_previous_checkpoint(tmp_path):
    spawn_local(_crash_worker, 2, str(tmp_path))


def test_memmap_text_trains_and_loss_falls(tmp_path):
    import subprocess
    import sys
    import sysconfig

    stdlib = sysconfig.get_paths()["stdlib"]
    out = tmp_path / "pystdlib"
    subprocess.run(
        [sys.executable, "tools/prepare_data.py", "--src", stdlib, "--glob", "json/*.py",
         "--out", str(out)], check=True, cwd=Path(__file__).resolve().parent.parent,
    )
    cfg = small_cfg(tmp_path / "mm", steps=30)
    cfg = replace(cfg, data=MemmapData(path=str(out), seq_len=128, batch_per_dp_rank=4),
                  optim=OptimConfig(lr=3e-3, warmup_steps=5))
    hist = _run(cfg)
    first = sum(hist[s]["loss"] for s in (1, 2, 3)) / 3
    last = sum(hist[s]["loss"] for s in (28, 29, 30)) / 3
    assert last < 0.7 * first, (first, last)


def test_activation_checkpointing_and_bf16(tmp_path):
    base = _run(small_cfg(tmp_path / "base", steps=3))
    ckpt = _run(small_cfg(tmp_path / "ckpt", steps=3, activation_checkpointing=True))
    for s in (1, 2, 3):  # recomputation changes nothing
        assert abs(base[s]["loss"] - ckpt[s]["loss"]) <= 1e-6 * base[s]["loss"], s
    bf16 = _run(small_cfg(tmp_path / "bf16", steps=3, dtype="bf16"))
    for s in (1, 2, 3):  # autocast bf16 follows fp32 closely for a few steps
        assert abs(base[s]["loss"] - bf16[s]["loss"]) <= 0.05 * base[s]["loss"], s
