"""dp > 1 with real groups: 4 gloo ranks as (ulysses, ring, dp) = (2, 1, 2) and (1, 2, 2).

Each dp replica attends over its own sequence only, draws its own share of the global
batch, and training on dp x sp gives the losses of the same global batch on sp alone;
checkpoints written under dp = 2 resume under dp = 2 and under dp = 1.
"""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from _cases import check_case
from usp import SequenceLayout, SPMesh
from usp.config import MemmapData, RecallData, LoggingConfig, ModelConfig, OptimConfig, ParallelConfig, TrainerConfig
from usp.launch import spawn_local
from usp.data.dataset import build_dataset
from usp.train.phase_runner import RunConfig, train

LAYOUTS = [(2, 1), (1, 2)]  # (ulysses, ring); dp = 2 on 4 ranks
DP = 2
QUIET = LoggingConfig(wandb="disabled", jsonl=True, plot=False, progress=False)
MODEL = ModelConfig(vocab_size=320, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64)


def _mesh(u, r):
    return SPMesh.build(ulysses=u, ring=r, dp=DP, ranks_per_node=max(1, u))


def _dp_gather(mesh, x):
    """Every dp replica's ``x``, in dp-coordinate order (dp_rank 0 first)."""
    parts = [None] * mesh.dp
    dist.all_gather_object(parts, (mesh.dp_rank, x), group=mesh.group("dp"))
    return [t for _, t in sorted(parts, key=lambda p: p[0])]


# ------------------------------------------------------------- attention and data split
def _check_attention(mesh):
    """usp_attention fwd + bwd on this replica's own q, k, v equals fp64 dense attention of
    that replica's full sequence: an all-to-all or ring step crossing replicas would mix."""
    cases = [dict(batch=1, seq_len=32, hq=4, hkv=2, d=8, causal=True, balance="zigzag"),
             dict(batch=2, seq_len=16, hq=2, hkv=2, d=8, causal=False, balance="contiguous")]
    for i, case in enumerate(cases):
        seed = 100 * i + mesh.dp_rank  # each dp replica its own q, k, v, dout
        check_case(mesh, seed=seed, dtype=torch.float32, kernel="torch", **case)
        q = torch.randn(case["batch"], case["seq_len"], case["hq"], case["d"],
                        generator=torch.Generator().manual_seed(seed))  # check_case's q
        a, b = _dp_gather(mesh, q)
        assert not torch.equal(a, b), "both replicas saw the same q: mixing would not show"


def _check_data(mesh, memmap_prefix):
    """The trainer's batches on this mesh: the dp replicas draw different samples that
    together are one process's batch of ``batch * dp``, in order, for both datasets."""
    seq_len, batch = 64, 3
    layout = SequenceLayout(mesh, seq_len=seq_len, balance="zigzag")
    for dc in (RecallData(seq_len=seq_len, n_pairs=8, n_queries=4),
               MemmapData(path=memmap_prefix, seq_len=seq_len)):
        data = build_dataset(dc, MODEL)
        for step in (0, 3):
            tokens, labels = data.batch(step, batch, mesh.dp_rank, mesh.dp,
                                        positions=layout.positions())  # [B, L/P] each
            assert tokens.shape == labels.shape == (batch, seq_len // mesh.sp_size)
            full = [layout.gather(t, dim=1) for t in (tokens, labels)]  # [B, L/P] -> [B, L]
            (t0, l0), (t1, l1) = _dp_gather(mesh, full)
            assert not torch.equal(t0, t1), (dc.kind, step, "replicas drew the same samples")
            want_t, want_l = data.batch(step, batch * mesh.dp, 0, 1, positions=None)
            assert torch.equal(torch.cat([t0, t1]), want_t), (dc.kind, step)
            assert torch.equal(torch.cat([l0, l1]), want_l), (dc.kind, step)


def _check_replicas(root, memmap_prefix):
    """Both layouts' attention and data checks (they assert on every rank); each rank leaves
    a mark once they passed."""
    for u, r in LAYOUTS:
        with _mesh(u, r) as mesh:
            assert mesh.dp == DP and mesh.sp_size == u * r
            _check_attention(mesh)
            _check_data(mesh, memmap_prefix)
    Path(root, f"replicas_checked_r{dist.get_rank()}").write_text("")


def test_dp_replicas_attend_and_draw_only_their_own_data(dp2_root):
    assert sorted(p.name for p in dp2_root.glob("replicas_checked_r*")) == [
        f"replicas_checked_r{r}" for r in range(2 * DP)]


# ------------------------------------------------------------------------- training
def _cfg(run_dir, u, r, dp, batch_size, steps=5, **trainer_kw) -> RunConfig:
    return RunConfig(
        model=MODEL,
        parallel=ParallelConfig(ulysses_degree=u, ring_degree=r, dp_degree=dp,
                                ranks_per_node=max(u, 1)),
        data=RecallData(seq_len=64, batch_per_dp_rank=batch_size, n_pairs=8, n_queries=4,
                        eval_batches=0),
        optim=OptimConfig(lr=3e-3, warmup_steps=2),
        trainer=TrainerConfig(steps=steps, run_dir=str(run_dir), nprocs=u * r * dp,
                              log_every=0, **trainer_kw),
        logging=QUIET,
    )


B = 2  # sequences per dp replica under dp = 2; dp = 1 runs take B * DP (same global batch)


def _dp2_worker(root, memmap_prefix):
    """World 4: the replica checks, then several runs, in one spawn (process start-up
    dominates the cost)."""
    _check_replicas(root, memmap_prefix)
    root = Path(root)
    for u, r in LAYOUTS:
        train(_cfg(root / f"dp2_{u}x{r}", u, r, DP, B))
    stopped, moved = root / "stopped", root / "moved"
    train(_cfg(stopped, 2, 1, DP, B, stop_after=3))  # "crash" after the step-3 checkpoint
    if dist.get_rank() == 0:
        shutil.copytree(stopped, moved)
    dist.barrier()
    # Resumed with another init seed: only the loaded checkpoint can give the straight
    # run's losses (a fresh start would give them too, with the same seed).
    train(_cfg(stopped, 2, 1, DP, B, seed=7))  # resumed under (2, 1, 2)
    train(_cfg(moved, 2, 2, 1, B * DP, seed=7))  # resumed under (2, 2, 1), same global batch


def _dp1_worker(root):
    for u, r in LAYOUTS:  # world 2: the same sp layouts without dp
        train(_cfg(Path(root) / f"dp1_{u}x{r}", u, r, 1, B * DP))


def _metrics(run_dir) -> dict:
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return {rec["step"]: rec for rec in map(json.loads, lines)}


@pytest.fixture(scope="module")
def dp2_root(tmp_path_factory):
    from usp.data.files import TokenWriter

    root = tmp_path_factory.mktemp("dp2")
    prefix = root / "tokens"
    with TokenWriter(prefix, vocab_size=MODEL.vocab_size, tokenizer="test", source="rng") as w:
        w.write(np.random.default_rng(0).integers(0, MODEL.vocab_size, 5000))
    spawn_local(_dp2_worker, 2 * DP, str(root), str(prefix))
    return root


@pytest.fixture(scope="module")
def dp1_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("dp1")
    spawn_local(_dp1_worker, 2, str(root))
    return root


def _close(a: dict, b: dict, steps, rel: float, keys=("loss",)):
    for s in steps:
        for k in keys:
            x, y = a[s][k], b[s][k]
            assert abs(x - y) <= rel * abs(x), (k, s, x, y)


@pytest.mark.parametrize("u,r", LAYOUTS)
def test_dp2_trains_like_dp1_with_the_global_batch(u, r, dp2_root, dp1_root):
    dp2, dp1 = _metrics(dp2_root / f"dp2_{u}x{r}"), _metrics(dp1_root / f"dp1_{u}x{r}")
    assert sorted(dp2) == sorted(dp1) == [1, 2, 3, 4, 5]
    # the loss normalised over dp x sp and FSDP's gradient reduction over dp x sp are
    # exact: the same global gradient norm and, after the updates, the same losses
    _close(dp1, dp2, range(1, 6), 1e-4, keys=("loss", "grad_norm"))
    assert dp2[5]["loss"] < dp2[1]["loss"]  # and it learns


def test_dp2_checkpoint_resumes_under_dp2_and_dp1(dp2_root):
    straight = _metrics(dp2_root / "dp2_2x1")
    assert (dp2_root / "moved" / "checkpoints" / "step_000003").is_dir()
    resumed, regrouped = _metrics(dp2_root / "stopped"), _metrics(dp2_root / "moved")
    assert sorted(resumed) == sorted(regrouped) == [1, 2, 3, 4, 5]
    _close(straight, resumed, (4, 5), 1e-6)  # same layout: fp32 round-off only
    _close(straight, regrouped, (4, 5), 1e-4)  # (2, 1, 2) -> (2, 2, 1)
