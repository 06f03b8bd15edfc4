"""Training app: layout-independent losses, resume, crash-safe checkpoints, memmap data.

Process start-up dominates on CPU, so the runs are made by two spawns shared by the tests
(module fixture ``runs``): one rank for the (ulysses, ring) = (1, 1) run, and four ranks
for every other run, one after another in one process group (``_four_rank_runs``). Each
test asserts on the run directories its runs wrote.
"""

import json
import shutil
import subprocess
import sys
import sysconfig
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from usp.config import MemmapData, RecallData, LoggingConfig, ModelConfig, OptimConfig, ParallelConfig, TrainerConfig
from usp.launch import spawn_local
from usp.train.phase_runner import RunConfig, train

ROOT = Path(__file__).resolve().parents[2]
QUIET = LoggingConfig(wandb="disabled", jsonl=True, plot=False, progress=False)
STEPS = 6  # every (2, 2) run's schedule; stop_after cuts a run short on it


def small_cfg(run_dir, u=2, r=2, steps=STEPS, **trainer_kw) -> RunConfig:
    return RunConfig(
        model=ModelConfig(vocab_size=320, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128),
        parallel=ParallelConfig(ulysses_degree=u, ring_degree=r, ranks_per_node=max(u, 1)),
        data=RecallData(seq_len=128, batch_per_dp_rank=2, n_pairs=8, n_queries=8),
        optim=OptimConfig(lr=3e-3, warmup_steps=2),
        trainer=TrainerConfig(steps=steps, run_dir=str(run_dir), nprocs=u * r, **trainer_kw),
        logging=QUIET,
    )


def memmap_cfg(run_dir, prefix) -> RunConfig:
    cfg = small_cfg(run_dir, steps=30)
    return replace(cfg, data=MemmapData(path=str(prefix), seq_len=128, batch_per_dp_rank=4),
                   optim=OptimConfig(lr=3e-3, warmup_steps=5))


LAYOUTS = [(4, 1), (1, 4)]  # (ulysses, ring) a (2, 2) checkpoint resumes under


def _crash_during_save(run_dir):
    from torch.distributed.fsdp import fully_shard

    import usp.models.checkpoint as ck

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
    Path(run_dir, f"verified_r{dist.get_rank()}").write_text("")


def _four_rank_runs(root, prefix):
    """Every 4-rank run, in one process group; the tests read their run directories."""
    root = Path(root)
    train(small_cfg(root / "straight"))  # uninterrupted (2, 2)
    # interrupted at step 3 (checkpoint written) under (ulysses, ring) = (2, 2)
    train(small_cfg(root / "resumed", stop_after=3))
    if dist.get_rank() == 0:  # copies of that run directory resume under the other layouts
        (root / "stopped.json").write_text(json.dumps(sorted(
            p.name for p in (root / "resumed" / "checkpoints").iterdir())))
        for u, r in LAYOUTS:
            shutil.copytree(root / "resumed", root / f"re_{u}x{r}")
    dist.barrier()
    # another init seed: only the checkpoint can give the straight run's losses
    train(small_cfg(root / "resumed", seed=7))
    for u, r in LAYOUTS:
        train(small_cfg(root / f"re_{u}x{r}", u=u, r=r, seed=7))
    # the first 3 steps of the straight run's schedule, recomputed and in bf16
    train(small_cfg(root / "ckpt", stop_after=3, activation_checkpointing=True))
    train(small_cfg(root / "bf16", stop_after=3, dtype="bf16"))
    train(memmap_cfg(root / "mm", prefix))
    _crash_during_save(str(root / "crash"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("train")
    prefix = root / "pystdlib"  # python -m usp.data.prepare end to end: the memmap run's tokens
    subprocess.run(
        [sys.executable, "-m", "usp.data.prepare", "--src", sysconfig.get_paths()["stdlib"],
         "--glob", "json/*.py", "--out", str(prefix)], check=True, cwd=ROOT,
    )
    spawn_local(train, 1, small_cfg(root / "one", u=1, r=1))
    spawn_local(_four_rank_runs, 4, str(root), str(prefix))
    return root


def _metrics(run_dir) -> dict:
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return {rec["step"]: rec for rec in map(json.loads, lines)}


def test_same_losses_1x1_and_2x2(runs):
    one, four = _metrics(runs / "one"), _metrics(runs / "straight")
    assert sorted(one) == sorted(four) == list(range(1, STEPS + 1))
    for s in one:
        a, b = one[s]["loss"], four[s]["loss"]
        assert abs(a - b) <= 1e-4 * abs(a), (s, a, b)
    assert one[STEPS]["loss"] < one[1]["loss"]  # and it learns
    for rec in four.values():  # a per-step peak where Linux allows resetting it
        assert rec["peak_mem_kind"] in ("rss_step", "rss_since_start") and rec["peak_mem_mb"] > 0
        assert rec["attn_comm_clock"] == "host" and 0 < rec["attn_comm_share"] < 1  # gloo
        assert rec["attn_work_imbalance"] == 1.0  # zigzag, causal, no documents: exact


def test_resume_matches_uninterrupted_and_across_layouts(runs):
    straight, resumed = _metrics(runs / "straight"), _metrics(runs / "resumed")
    assert "step_000003" in json.loads((runs / "stopped.json").read_text())  # when stopped
    assert sorted(resumed) == list(range(1, STEPS + 1))
    for s in (4, 5, 6):
        assert abs(resumed[s]["loss"] - straight[s]["loss"]) <= 1e-6 * straight[s]["loss"], s
    for u, r in LAYOUTS:
        moved = _metrics(runs / f"re_{u}x{r}")
        for s in (4, 5, 6):
            a, b = straight[s]["loss"], moved[s]["loss"]
            assert abs(a - b) <= 1e-4 * a, (u, r, s, a, b)


def test_crash_during_save_keeps_previous_checkpoint(runs):
    # the checks run on every rank (``_crash_during_save``); each rank leaves a mark after them
    assert sorted(p.name for p in (runs / "crash").glob("verified_r*")) == [
        f"verified_r{r}" for r in range(4)]
    assert sorted(p.name for p in (runs / "crash" / "checkpoints").iterdir()) == [
        "step_000001", "step_000003"]


def test_memmap_text_trains_and_loss_falls(runs):
    hist = _metrics(runs / "mm")
    first = sum(hist[s]["loss"] for s in (1, 2, 3)) / 3
    last = sum(hist[s]["loss"] for s in (28, 29, 30)) / 3
    assert last < 0.7 * first, (first, last)


def test_activation_checkpointing_and_bf16(runs):
    base, ckpt, bf16 = (_metrics(runs / name) for name in ("straight", "ckpt", "bf16"))
    assert sorted(ckpt) == sorted(bf16) == [1, 2, 3]
    for s in (1, 2, 3):  # recomputation changes nothing
        assert abs(base[s]["loss"] - ckpt[s]["loss"]) <= 1e-6 * base[s]["loss"], s
    for s in (1, 2, 3):  # autocast bf16 follows fp32 closely for a few steps
        assert abs(base[s]["loss"] - bf16[s]["loss"]) <= 0.05 * base[s]["loss"], s
