"""Checkpoint files that can be trusted: a manifest per checkpoint, damaged checkpoints named
and skipped for the previous one, pruning that keeps intact ones (2 gloo ranks write them).
The resume-config checks: ``unit/test_checkpoint_resume.py``."""

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import usp.models.checkpoint as ck
from usp.train.fingerprint import run_fingerprint
from usp.launch import spawn_local

from _checkpoint_cfg import run_cfg

SHARD = "__1_0.distcp"  # written by rank 1 of the 2-rank template


def _tiny():
    """A 2-rank FSDP Linear, its AdamW and a scheduler (every rank)."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters())
    return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)


def _weight(model) -> torch.Tensor:
    return model.weight.full_tensor()


def _write_steps(run_dir, fingerprint):
    model, opt, sched = _tiny()
    for step in (1, 2, 3):  # the weight holds the step, so a load shows which one it read
        with torch.no_grad():
            model.weight.fill_(float(step))
        ck.save_checkpoint(run_dir, step, model, opt, sched, keep=5, fingerprint=fingerprint)


def _write_then_choose(run_dir, collective_dir, fingerprint, changed):
    """The template's checkpoints, then ``_collective`` on a copy of them whose newest has a
    truncated shard (one spawn: process start-up dominates)."""
    _write_steps(run_dir, fingerprint)
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.copytree(run_dir, collective_dir)
        _truncate(_step3(Path(collective_dir)))  # rank 1's shard: both ranks must skip it
    dist.barrier()
    _collective(collective_dir, fingerprint, changed)
    Path(collective_dir, f"checked_r{dist.get_rank()}").write_text("")


@pytest.fixture(scope="module")
def template(tmp_path_factory) -> Path:
    """A run directory with step_000001..3, written by 2 gloo ranks; next to it
    ``collective``, where the same 2 ranks ran ``_collective`` on a damaged copy."""
    root = tmp_path_factory.mktemp("ckpt")
    changed = run_fingerprint(run_cfg(optim={"lr": 1e-3}))
    spawn_local(_write_then_choose, 2, str(root / "run"), str(root / "collective"),
                run_fingerprint(run_cfg()), changed)
    return root / "run"


def _copy(template, tmp_path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(template, run)
    return run


def _step3(run) -> Path:
    return run / "checkpoints" / "step_000003"


def test_manifest_lists_every_file_with_size_and_sha256(template):
    path = _step3(template)
    manifest = json.loads((path / "manifest.json").read_text())
    on_disk = sorted(str(f.relative_to(path)) for f in path.rglob("*") if f.is_file())
    assert sorted(manifest["files"]) == [f for f in on_disk if f != "manifest.json"]
    assert {"__0_0.distcp", SHARD, ".metadata", "extra.pt", "rng_rank0.pt", "rng_rank1.pt"} \
        <= set(manifest["files"])  # both ranks' shards and RNG states, rank 0's extra files
    for name, rec in manifest["files"].items():
        data = (path / name).read_bytes()
        assert rec == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}, name
    assert manifest["step"] == 3 and manifest["fingerprint"] == run_fingerprint(run_cfg())


def _truncate(path):
    f = path / SHARD
    f.write_bytes(f.read_bytes()[:-7])


def _garble(path):  # same size, different bytes
    f = path / SHARD
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF
    f.write_bytes(bytes(data))


@pytest.mark.parametrize("damage, why", [
    (_truncate, f"{SHARD} is "),
    (_garble, f"{SHARD} fails its sha256"),
    (lambda p: (p / "rng_rank1.pt").unlink(), "missing file rng_rank1.pt"),
    (lambda p: (p / "manifest.json").unlink(), "no manifest.json"),
])
def test_damaged_newest_is_named_and_skipped(template, tmp_path, damage, why):
    run = _copy(template, tmp_path)
    assert ck.latest_checkpoint(run, log=pytest.fail) == _step3(run)  # intact: the newest
    damage(_step3(run))
    lines = []
    assert ck.latest_checkpoint(run, log=lines.append) == run / "checkpoints" / "step_000002"
    assert len(lines) == 1 and str(_step3(run)) in lines[0] and why in lines[0], lines


def test_checkpoint_from_before_manifests_is_accepted_with_a_warning(template, tmp_path):
    run = _copy(template, tmp_path)
    path = _step3(run)
    (path / "manifest.json").unlink()
    extra = torch.load(path / "extra.pt", weights_only=False)
    del extra["format"]  # what an older usp wrote
    torch.save(extra, path / "extra.pt")
    lines = []
    assert ck.latest_checkpoint(run, log=lines.append) == path
    assert len(lines) == 1 and "predates manifests" in lines[0] and str(path) in lines[0]


def _collective(run_dir, fingerprint, changed):
    rank = dist.get_rank()
    model, opt, sched = _tiny()
    lines = []
    chosen = ck.choose_checkpoint(run_dir, log=lines.append)
    # every rank takes the same, intact checkpoint; only rank 0 names the damaged one
    assert chosen == Path(run_dir) / "checkpoints" / "step_000002", chosen
    assert len(lines) == (rank == 0), lines
    assert not lines or ("step_000003" in lines[0] and SHARD in lines[0]), lines
    with pytest.raises(ValueError, match=r"optim\.lr: 0\.003 -> 0\.001"):
        ck.load_checkpoint(chosen, model, opt, sched, fingerprint=changed)
    ck.load_checkpoint(chosen, model, opt, sched, fingerprint=fingerprint)
    assert torch.equal(_weight(model), torch.full((4, 4), 2.0))
    # pruning: the new checkpoint and the newest intact one stay, the damaged one goes
    ck.save_checkpoint(run_dir, 4, model, opt, sched, keep=2, fingerprint=fingerprint)
    names = sorted(p.name for p in (Path(run_dir) / "checkpoints").iterdir())
    assert names == ["step_000002", "step_000004"], names
    dist.barrier()
    for p in ck.step_dirs(run_dir):  # nothing left verifies: an error, not a fresh start
        if rank == 0:
            _truncate(p)
    dist.barrier()
    with pytest.raises(ValueError, match="none of the 2 checkpoints"):
        ck.choose_checkpoint(run_dir, log=lambda line: None)


def test_choose_checkpoint_is_collective_and_pruning_keeps_intact(template):
    # the checks run on both ranks (``_collective``); each rank leaves a mark after them
    done = template.parent / "collective"
    assert sorted(p.name for p in done.glob("checked_r*")) == ["checked_r0", "checked_r1"]
