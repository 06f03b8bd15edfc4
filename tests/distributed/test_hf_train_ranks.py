"""usp-train with a transformers model (``model.hf``) on gloo ranks: the same losses at (1,1)
and (2,2), the loss falls, bf16 with activation checkpointing follows fp32, a (2,2)
checkpoint resumes, its export loads with ``from_pretrained`` and gives the logits of the
trained, usp-patched model, and the state offload's CPU stand-in trains as (1,1) does."""

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from usp.config import ModelConfig, RunConfig
from usp.models.export import export_checkpoint
from usp.models.hf_model import check_pretrained
from usp.launch import spawn_local
from usp.data.dataset import build_dataset
from usp.run import resolve_run
from usp.train.phase_runner import train

from _hf_runs import MODEL, checkpointed_model, small_cfg
from _state_offload import shard_calls, train_as_cuda

pytest.importorskip("transformers")


def _run(cfg: RunConfig, fn=train) -> dict:
    spawn_local(fn, cfg.trainer.nprocs, cfg)
    lines = (Path(cfg.trainer.run_dir) / "metrics.jsonl").read_text().splitlines()
    return {rec["step"]: rec["loss"] for rec in map(json.loads, lines)}


def _logits_worker(cfg: RunConfig, exported: str, out: str) -> None:
    """Rank 0 asserts: the trained model (checkpoint loaded into the patched, sharded model
    at (2,2)) and the exported directory (one process, no usp) give the same logits."""
    from transformers import AutoModelForCausalLM

    from usp.layout import SequenceLayout
    from usp.data.indexing import held_out_batch
    from usp.mesh import SPMesh
    from usp.models.forward import forward

    with SPMesh.build(ulysses=2, ring=2) as mesh:
        layout = SequenceLayout(mesh, seq_len=cfg.data.seq_len)
        model, opt, sched = checkpointed_model(cfg, resolve_run(cfg, 4, "cpu"), mesh, layout)
        data = build_dataset(cfg.data, cfg.model)
        positions = layout.positions()
        b = data.model_batch(held_out_batch(0), 2, 0, 1, positions=positions)
        with torch.no_grad():
            mine = layout.gather(forward(model.eval(), b, positions), dim=1)  # [B, L, V]
        del model, opt, sched
    if dist.get_rank() == 0:
        full = data.model_batch(held_out_batch(0), 2, 0, 1, positions=torch.arange(cfg.data.seq_len))
        ref = AutoModelForCausalLM.from_pretrained(exported, local_files_only=True).eval()
        with torch.no_grad():
            want = ref(input_ids=full.tokens).logits
        err = (mine - want).abs().max().item()
        assert err <= 1e-4 * want.abs().max().item(), err
        torch.save(err, out)


def test_hf_llama_trains_the_same_at_1x1_and_2x2_resumes_and_exports(tmp_path):
    one = _run(small_cfg(tmp_path / "one", u=1, r=1))
    # (2,2) stopped after step 3, resumed with another init seed: only the checkpoint can
    # give the uninterrupted (1,1) losses of steps 4..6
    first = _run(small_cfg(tmp_path / "four", stop_after=3))
    assert sorted(first) == [1, 2, 3]
    four = _run(small_cfg(tmp_path / "four", seed=7))
    assert sorted(one) == sorted(four) == [1, 2, 3, 4, 5, 6]
    for s in one:
        assert abs(one[s] - four[s]) <= 1e-4 * one[s], (s, one[s], four[s])
    assert one[6] < 0.9 * one[1], one  # it learns
    # bf16 (FSDP mixed precision) with activation checkpointing follows fp32 closely
    mixed = _run(small_cfg(tmp_path / "mixed", steps=3, dtype="bf16",
                           activation_checkpointing=True))
    for s in (1, 2, 3):
        assert abs(mixed[s] - one[s]) <= 0.05 * one[s], (s, mixed[s], one[s])
    # the state offload through its CPU stand-in (_state_offload): the (1,1) losses, FSDP2's
    # CPU offload on every layer's fully_shard and the root's
    state = _run(small_cfg(tmp_path / "state", steps=3, state_offload=True), train_as_cuda)
    for s in (1, 2, 3):
        assert abs(state[s] - one[s]) <= 1e-4 * one[s], (s, state[s], one[s])
    for rank in range(4):
        want = [("CPUOffloadPolicy", True)] * (MODEL.n_layers + 1)
        assert shard_calls(tmp_path / "state", rank) == want, rank
    assert (tmp_path / "four" / "hf_config" / "config.json").is_file()

    exported = tmp_path / "exported"
    export_checkpoint(tmp_path / "four", exported)
    assert (exported / "model.safetensors").is_file()
    out = tmp_path / "err.pt"
    spawn_local(_logits_worker, 4, small_cfg(tmp_path / "four"), str(exported), str(out))
    assert out.is_file()  # rank 0 compared the logits

    # the exported directory is a valid model.pretrained of the same shape, not of another
    check_pretrained(ModelConfig(**{**vars(MODEL), "pretrained": str(exported)}))
    with pytest.raises(ValueError, match="num_hidden_layers: 2 there, 3 from model.n_layers"):
        check_pretrained(ModelConfig(**{**vars(MODEL), "pretrained": str(exported),
                                        "n_layers": 3}))
    with pytest.raises(ValueError, match="is a llama model but model.hf=qwen2"):
        check_pretrained(ModelConfig(**{**vars(MODEL), "pretrained": str(exported),
                                        "hf": "qwen2"}))
